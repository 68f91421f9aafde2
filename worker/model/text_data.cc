#include "worker/model/text_data.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/model/byte_tokenizer.h"
#include "worker/model/corpus.h"
#include "worker/model/token_shards.h"
#include "worker/model/tokenizer.h"

namespace detour::model {

namespace fs = std::filesystem;

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

absl::Status CheckUtf8(absl::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    int len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("invalid UTF-8 lead byte at offset ", i));
    }
    if (i + len > n) {
      return absl::InvalidArgumentError(absl::StrCat("truncated UTF-8 sequence at offset ", i));
    }
    for (int k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) {
        return absl::InvalidArgumentError(
            absl::StrCat("invalid UTF-8 continuation byte at offset ", i + k));
      }
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    const bool overlong =
        (len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000);
    if (overlong || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return absl::InvalidArgumentError(absl::StrCat("invalid UTF-8 code point at offset ", i));
    }
    i += len;
  }
  return absl::OkStatus();
}

namespace {

std::string MiB(uint64_t bytes) { return absl::StrCat(bytes, " bytes (", bytes >> 20, " MiB)"); }

absl::Status TooMuchText(const std::string& path, const std::string& held, uint64_t max_bytes) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "data path ", path, " holds ", held, " of text, more than the limit of ", MiB(max_bytes)));
}

// Appends the file's bytes to `text`, reading at most until `text` holds
// `max_bytes` + 1 bytes (the size from stat may be stale or 0, e.g. in /proc).
absl::Status AppendFile(const fs::path& path, const std::string& source, uint64_t max_bytes,
                        std::string* text) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("cannot open ", path.string(), ": ", std::strerror(errno)));
  }
  const size_t begin = text->size();
  char buffer[1 << 16];
  bool too_much = false;
  while (true) {
    const uint64_t room = max_bytes + 1 - std::min<uint64_t>(max_bytes + 1, text->size());
    if (room == 0) {
      too_much = true;
      break;
    }
    const size_t n = std::fread(buffer, 1, std::min<uint64_t>(sizeof(buffer), room), f);
    text->append(buffer, n);
    if (n == 0) break;
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (too_much || text->size() > max_bytes) {
    return TooMuchText(source, absl::StrCat("over ", MiB(max_bytes)), max_bytes);
  }
  if (failed) return absl::DataLossError(absl::StrCat("reading ", path.string(), " failed"));
  absl::Status utf8 = CheckUtf8(absl::string_view(*text).substr(begin));
  if (!utf8.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": ", utf8.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ReadTextSource(const std::string& path, uint64_t max_bytes) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) {
    return absl::NotFoundError(absl::StrCat("data path ", path, " not found"));
  }
  std::vector<fs::path> files;
  uint64_t total = 0;
  if (fs::is_directory(st)) {
    for (auto it = fs::recursive_directory_iterator(path, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      std::error_code size_ec;
      if (!it->is_regular_file(size_ec)) continue;  // devices, FIFOs, sockets: skipped
      if (files.size() >= kMaxTextSourceFiles) {
        return absl::ResourceExhaustedError(
            absl::StrCat("data path ", path, " holds more than ", kMaxTextSourceFiles, " files"));
      }
      const uintmax_t size = it->file_size(size_ec);
      if (size_ec) {
        return absl::InternalError(
            absl::StrCat("size of ", it->path().string(), ": ", size_ec.message()));
      }
      total += size + (files.empty() ? 0 : 1);  // files are joined by "\n"
      if (total > max_bytes) {
        return TooMuchText(path, absl::StrCat("at least ", MiB(total)), max_bytes);
      }
      files.push_back(it->path());
    }
    if (ec) {
      return absl::InternalError(absl::StrCat("listing ", path, ": ", ec.message()));
    }
    std::sort(files.begin(), files.end());
  } else if (fs::is_regular_file(st)) {
    total = fs::file_size(path, ec);
    if (ec) return absl::InternalError(absl::StrCat("size of ", path, ": ", ec.message()));
    if (total > max_bytes) return TooMuchText(path, MiB(total), max_bytes);
    files.push_back(path);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("data path ", path,
                     " is neither a regular file nor a directory (a device, FIFO or "
                     "socket is never read)"));
  }
  std::string text;
  text.reserve(total);
  for (const fs::path& f : files) {
    if (!text.empty()) text += '\n';
    RETURN_IF_ERROR(AppendFile(f, path, max_bytes, &text));
  }
  if (text.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("data path ", path, " holds no text"));
  }
  return text;
}

absl::StatusOr<TextDataset> SplitText(absl::string_view text, double validation_fraction) {
  if (!(validation_fraction >= 0.0 && validation_fraction <= 0.5)) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.validation_fraction: ", validation_fraction, " is outside [0, 0.5]"));
  }
  size_t cut =
      text.size() - static_cast<size_t>(static_cast<double>(text.size()) * validation_fraction);
  if (cut < text.size()) {
    const size_t nl = text.find('\n', cut);
    if (nl != absl::string_view::npos && nl + 1 < text.size()) cut = nl + 1;
  }
  TextDataset ds;
  ds.train = ByteTokenizer::Encode(text.substr(0, cut));
  ds.validation = ByteTokenizer::Encode(text.substr(cut));
  return ds;
}

absl::StatusOr<TextDataset> LoadDataset(const v1::DataSpec& data) {
  const double fraction = data.validation_fraction() > 0 ? data.validation_fraction() : 0.05;
  if (data.source() == v1::DATA_SOURCE_SHARDS) return LoadShardDataset(data);
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Load(data.tokenizer()));
  std::string text;
  if (data.source() == v1::DATA_SOURCE_TEXT) {
    if (data.path().empty()) {
      return absl::InvalidArgumentError("data.path: required when data.source is DATA_SOURCE_TEXT");
    }
    ASSIGN_OR_RETURN(text, ReadTextSource(data.path()));
  }
  const absl::string_view source = data.source() == v1::DATA_SOURCE_TEXT
                                       ? absl::string_view(text)
                                       : absl::string_view(EmbeddedCorpus());
  if (tokenizer->kind() == "byte") return SplitText(source, fraction);
  // The same line-aligned cut as SplitText, then each part tokenised.
  ASSIGN_OR_RETURN(TextDataset bytes, SplitText(source, fraction));
  const size_t cut = static_cast<size_t>(bytes.train.size());
  ASSIGN_OR_RETURN(std::vector<int32_t> train, tokenizer->Encode(source.substr(0, cut)));
  ASSIGN_OR_RETURN(std::vector<int32_t> validation, tokenizer->Encode(source.substr(cut)));
  TextDataset ds;
  ds.train = std::move(train);
  ds.validation = std::move(validation);
  ds.tokenizer_checksum = tokenizer->checksum();
  ds.vocab_size = tokenizer->vocab_size();
  return ds;
}

TokenSequence::TokenSequence(std::vector<int32_t> tokens) {
  auto owned = std::make_shared<const std::vector<int32_t>>(std::move(tokens));
  data_ = reinterpret_cast<const uint8_t*>(owned->data());
  size_ = static_cast<int64_t>(owned->size());
  token_bytes_ = 4;
  owner_ = std::move(owned);
}

TokenSequence TokenSequence::View(std::shared_ptr<const void> owner, const uint8_t* data,
                                  int64_t count, int token_bytes) {
  TokenSequence t;
  t.owner_ = std::move(owner);
  t.data_ = data;
  t.size_ = count;
  t.token_bytes_ = token_bytes == 2 ? 2 : 4;
  return t;
}

std::vector<int32_t> TokenSequence::Slice(int64_t begin, int64_t n) const {
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = (*this)[begin + i];
  return out;
}

absl::Status CheckVocabulary(const TextDataset& data, int model_vocab_size) {
  if (data.vocab_size > model_vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.vocab_size ", model_vocab_size,
                     " is smaller than the tokenizer's vocabulary of ", data.vocab_size, " (",
                     data.tokenizer_checksum, "); set model.vocab_size >= ", data.vocab_size));
  }
  return absl::OkStatus();
}

void CopySample(const TokenSequence& tokens, int64_t index, int context_length, int64_t* out) {
  const int64_t begin = index * context_length;
  for (int t = 0; t <= context_length; ++t) out[t] = tokens[begin + t];
}

int64_t NumSamples(int64_t num_tokens, int context_length) {
  if (context_length <= 0 || num_tokens <= context_length) return 0;
  return (num_tokens - 1) / context_length;
}

absl::Span<const int32_t> SampleTokens(absl::Span<const int32_t> tokens, int64_t index,
                                       int context_length) {
  return tokens.subspan(static_cast<size_t>(index) * context_length, context_length + 1);
}

SampleSharder::SampleSharder(int64_t num_samples, int num_data_nodes, uint64_t seed)
    : num_samples_(num_samples),
      num_data_nodes_(num_data_nodes < 1 ? 1 : num_data_nodes),
      seed_(seed) {
  int bits = 2;
  while ((int64_t{1} << bits) < num_samples_) ++bits;
  if (bits % 2 != 0) ++bits;
  half_bits_ = bits / 2;
}

int64_t SampleSharder::Permute(uint64_t epoch, int64_t position) const {
  const uint64_t mask = (uint64_t{1} << half_bits_) - 1;
  uint64_t x = static_cast<uint64_t>(position);
  do {
    uint64_t left = x >> half_bits_;
    uint64_t right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      uint64_t key = seed_ ^ (epoch * 0x100000001b3ULL) ^ (round << 56) ^ right;
      const uint64_t f = SplitMix64(&key) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half_bits_) | right;
  } while (x >= static_cast<uint64_t>(num_samples_));
  return static_cast<int64_t>(x);
}

int64_t SampleSharder::SampleAt(int data_node, uint64_t shard_offset) const {
  if (num_samples_ <= 0) return 0;
  const uint64_t global =
      shard_offset * static_cast<uint64_t>(num_data_nodes_) + static_cast<uint64_t>(data_node);
  const uint64_t n = static_cast<uint64_t>(num_samples_);
  return Permute(global / n, static_cast<int64_t>(global % n));
}

}  // namespace detour::model
