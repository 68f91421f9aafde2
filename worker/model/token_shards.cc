#include "worker/model/token_shards.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/status.h"
#include "common/checkpoint_manifest.h"
#include "worker/model/tokenizer.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

constexpr char kManifest[] = "manifest.json";
constexpr char kTokenizerFile[] = "tokenizer.model";

std::string Errno() { return std::strerror(errno); }

// A new file written through a buffer, checksummed, synced on Close.
class OutFile {
 public:
  absl::Status Open(const std::string& path) {
    path_ = path;
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) return absl::UnavailableError(absl::StrCat("cannot create ", path, ": ", Errno()));
    buf_.reserve(kBuffer);
    return absl::OkStatus();
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  absl::Status Write(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    fnv_.Add(absl::string_view(reinterpret_cast<const char*>(b), n));
    bytes_ += n;
    buf_.insert(buf_.end(), b, b + n);
    return buf_.size() >= kBuffer ? Flush() : absl::OkStatus();
  }
  absl::Status Close() {
    RETURN_IF_ERROR(Flush());
    if (::fsync(fd_) != 0)
      return absl::UnavailableError(absl::StrCat("fsync ", path_, ": ", Errno()));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0)
      return absl::UnavailableError(absl::StrCat("close ", path_, ": ", Errno()));
    return absl::OkStatus();
  }
  std::string checksum() const { return fnv_.Hex(); }
  uint64_t bytes() const { return bytes_; }

 private:
  static constexpr size_t kBuffer = 1 << 20;
  absl::Status Flush() {
    size_t done = 0;
    while (done < buf_.size()) {
      const ssize_t n = ::write(fd_, buf_.data() + done, buf_.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        const std::string m = absl::StrCat("cannot write ", path_, ": ", std::strerror(err));
        return err == ENOSPC || err == EDQUOT ? absl::ResourceExhaustedError(m)
                                              : absl::UnavailableError(m);
      }
      done += static_cast<size_t>(n);
    }
    buf_.clear();
    return absl::OkStatus();
  }
  std::string path_;
  int fd_ = -1;
  std::vector<uint8_t> buf_;
  Fnv1a64 fnv_;
  uint64_t bytes_ = 0;
};

// One split being written: tokens and the document index.
struct SplitWriter {
  OutFile tokens;
  OutFile index;
  uint64_t num_tokens = 0;
  uint64_t documents = 0;
  int token_bytes = 2;

  absl::Status Open(const std::string& dir, const std::string& name, int width) {
    token_bytes = width;
    RETURN_IF_ERROR(tokens.Open(absl::StrCat(dir, "/", name, ".tokens")));
    RETURN_IF_ERROR(index.Open(absl::StrCat(dir, "/", name, ".index")));
    const uint64_t zero = 0;
    return index.Write(&zero, 8);
  }
  absl::Status Add(const std::vector<int32_t>& ids) {
    if (token_bytes == 2) {
      std::vector<uint16_t> v(ids.begin(), ids.end());
      RETURN_IF_ERROR(tokens.Write(v.data(), v.size() * 2));
    } else {
      std::vector<uint32_t> v(ids.begin(), ids.end());
      RETURN_IF_ERROR(tokens.Write(v.data(), v.size() * 4));
    }
    num_tokens += ids.size();
    ++documents;
    return index.Write(&num_tokens, 8);
  }
  absl::Status Close() {
    RETURN_IF_ERROR(tokens.Close());
    return index.Close();
  }
  void Describe(const std::string& name, v1::DatasetManifest::Split* s) const {
    s->set_tokens_file(name + ".tokens");
    s->set_index_file(name + ".index");
    s->set_tokens(num_tokens);
    s->set_documents(documents);
    s->set_tokens_checksum(tokens.checksum());
    s->set_index_checksum(index.checksum());
  }
};

absl::Status ListInputs(const std::vector<std::string>& inputs, std::vector<std::string>* files,
                        uint64_t* total) {
  for (const std::string& in : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(in, ec);
    if (ec || !fs::exists(st))
      return absl::NotFoundError(absl::StrCat(in, ": no such file or directory"));
    std::vector<std::string> found;
    if (fs::is_directory(st)) {
      for (fs::recursive_directory_iterator it(in, ec), end; !ec && it != end; it.increment(ec)) {
        if (it->is_regular_file(ec)) found.push_back(it->path().string());
        if (found.size() + files->size() > DatasetLimits::kMaxSources) {
          return absl::ResourceExhaustedError(
              absl::StrCat(in, ": more than ", DatasetLimits::kMaxSources, " files"));
        }
      }
      if (ec) return absl::UnavailableError(absl::StrCat("cannot list ", in, ": ", ec.message()));
      std::sort(found.begin(), found.end());
    } else if (fs::is_regular_file(st)) {
      found.push_back(in);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(in, ": not a regular file or directory (a device or FIFO is refused)"));
    }
    for (const std::string& f : found) {
      *total += fs::file_size(f, ec);
      files->push_back(f);
    }
  }
  if (*total > DatasetLimits::kMaxInputBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "inputs hold ", *total, " bytes, more than the limit ", DatasetLimits::kMaxInputBytes));
  }
  if (files->empty()) return absl::FailedPreconditionError("no input files");
  return absl::OkStatus();
}

// Validation membership of document `d`: a seeded hash, so the split depends
// only on the documents' order and the seed.
bool InValidation(uint64_t seed, uint64_t d, double fraction) {
  if (fraction <= 0) return false;
  uint64_t state = seed ^ (d * 0x9e3779b97f4a7c15ULL);
  const uint64_t h = SplitMix64(&state);
  return static_cast<double>(h >> 11) * 0x1.0p-53 < fraction;
}

bool SafeName(const std::string& name) {
  return !name.empty() && name.size() <= 255 && name.find('/') == std::string::npos &&
         name != "." && name != "..";
}

}  // namespace

// Lines of a file, read through a buffer, each bounded in bytes.
class DocumentReader::LineReader {
 public:
  explicit LineReader(const std::string& path) : path_(path) {
    f_ = std::fopen(path.c_str(), "rb");
  }
  ~LineReader() {
    if (f_ != nullptr) std::fclose(f_);
  }
  bool ok() const { return f_ != nullptr; }
  // Next line without its '\n'; false at the end (check status()).
  bool Next(std::string* line) {
    line->clear();
    if (f_ == nullptr || !status_.ok()) return false;
    bool any = false;
    for (;;) {
      const int c = std::getc(f_);
      if (c == EOF) {
        if (std::ferror(f_)) status_ = absl::DataLossError(absl::StrCat("error reading ", path_));
        if (any) ++line_;
        return any && status_.ok();
      }
      any = true;
      ++bytes_;
      if (c == '\n') {
        ++line_;
        return true;
      }
      if (line->size() >= DatasetLimits::kMaxDocumentBytes) {
        status_ = absl::InvalidArgumentError(
            absl::StrCat(path_, ":", line_ + 1, ": line longer than the limit of ",
                         DatasetLimits::kMaxDocumentBytes, " bytes"));
        return false;
      }
      line->push_back(static_cast<char>(c));
    }
  }
  uint64_t line() const { return line_; }
  uint64_t bytes() const { return bytes_; }
  const absl::Status& status() const { return status_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
  uint64_t line_ = 0;
  uint64_t bytes_ = 0;
  absl::Status status_;
};

DocumentReader::~DocumentReader() = default;

absl::StatusOr<std::unique_ptr<DocumentReader>> DocumentReader::Open(
    const std::vector<std::string>& inputs, TextDocuments text_documents,
    const std::string& jsonl_field) {
  if (inputs.empty()) return absl::InvalidArgumentError("no inputs");
  if (jsonl_field.empty()) return absl::InvalidArgumentError("empty JSONL field name");
  std::unique_ptr<DocumentReader> r(new DocumentReader());
  RETURN_IF_ERROR(ListInputs(inputs, &r->files_, &r->bytes_total_));
  r->text_documents_ = text_documents;
  r->jsonl_field_ = jsonl_field;
  return r;
}

uint64_t DocumentReader::bytes_done() const {
  return bytes_before_ + (reader_ != nullptr ? reader_->bytes() : 0);
}

void DocumentReader::FinishFile() {
  InputSource src;
  src.path = files_[next_file_];
  src.bytes = reader_->bytes();
  src.documents = file_documents_;
  bytes_before_ += src.bytes;
  sources_.push_back(std::move(src));
  reader_.reset();
  ++next_file_;
}

// Hands `*doc` out unless it is empty (then false: read on).
absl::StatusOr<bool> DocumentReader::Emit(std::string* doc, const std::string& where,
                                          std::string* text, std::string* where_out) {
  if (doc->empty()) return false;
  if (absl::Status s = CheckUtf8(*doc); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", s.message()));
  }
  text->swap(*doc);
  doc->clear();
  *where_out = where;
  ++file_documents_;
  return true;
}

absl::StatusOr<bool> DocumentReader::Next(std::string* text, std::string* where) {
  RETURN_IF_ERROR(status_);
  auto fail = [&](absl::Status s) {
    status_ = s;
    return s;
  };
  std::string line;
  for (;;) {
    if (reader_ == nullptr) {
      if (next_file_ >= files_.size()) return false;
      const std::string& file = files_[next_file_];
      reader_ = std::make_unique<LineReader>(file);
      if (!reader_->ok()) {
        return fail(absl::NotFoundError(absl::StrCat("cannot open ", file, ": ", Errno())));
      }
      jsonl_ = absl::EndsWith(file, ".jsonl");
      doc_.clear();
      doc_line_ = 0;
      file_documents_ = 0;
    }
    const std::string& file = files_[next_file_];
    if (!reader_->Next(&line)) {
      if (!reader_->status().ok()) return fail(reader_->status());
      // The end of the file ends its last paragraph (or the file's document).
      auto last = Emit(&doc_, absl::StrCat(file, ":", doc_line_), text, where);
      if (!last.ok()) return fail(last.status());
      FinishFile();
      if (*last) return true;
      continue;
    }
    absl::StatusOr<bool> out = false;
    if (jsonl_) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      google::protobuf::Struct obj;
      google::protobuf::util::JsonParseOptions po;
      const auto st = google::protobuf::util::JsonStringToMessage(line, &obj, po);
      if (!st.ok()) {
        return fail(absl::InvalidArgumentError(absl::StrCat(
            file, ":", reader_->line(), ": not a JSON object (", std::string(st.message()), ")")));
      }
      auto it = obj.fields().find(jsonl_field_);
      if (it == obj.fields().end() ||
          it->second.kind_case() != google::protobuf::Value::kStringValue) {
        return fail(absl::InvalidArgumentError(
            absl::StrCat(file, ":", reader_->line(), ": no string field \"", jsonl_field_, "\"")));
      }
      std::string value = it->second.string_value();
      out = Emit(&value, absl::StrCat(file, ":", reader_->line()), text, where);
    } else if (text_documents_ == TextDocuments::kLines) {
      line += '\n';
      out = Emit(&line, absl::StrCat(file, ":", reader_->line()), text, where);
    } else if (text_documents_ == TextDocuments::kParagraphs &&
               line.find_first_not_of(" \t\r") == std::string::npos) {
      out = Emit(&doc_, absl::StrCat(file, ":", doc_line_), text, where);
    } else {
      if (doc_.empty()) doc_line_ = reader_->line();
      if (doc_.size() + line.size() + 1 > DatasetLimits::kMaxDocumentBytes) {
        return fail(absl::InvalidArgumentError(absl::StrCat(
            file, ":", doc_line_, ": document longer than the limit of ",
            DatasetLimits::kMaxDocumentBytes, " bytes (use --documents paragraphs or lines)")));
      }
      doc_ += line;
      doc_ += '\n';
    }
    if (!out.ok()) return fail(out.status());
    if (*out) return true;
  }
}

absl::StatusOr<v1::DatasetManifest> PrepareDataset(const PrepareOptions& o) {
  if (!(o.validation_fraction >= 0 && o.validation_fraction <= 0.5)) {
    return absl::InvalidArgumentError(
        absl::StrCat("validation fraction ", o.validation_fraction, " is outside [0, 0.5]"));
  }
  if (o.output.empty()) return absl::InvalidArgumentError("no output directory");
  if (o.inputs.empty()) return absl::InvalidArgumentError("no inputs");
  if (o.jsonl_field.empty()) return absl::InvalidArgumentError("empty JSONL field name");
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Load(o.tokenizer_path));
  ASSIGN_OR_RETURN(std::unique_ptr<DocumentReader> reader,
                   DocumentReader::Open(o.inputs, o.text_documents, o.jsonl_field));

  std::error_code ec;
  const std::string out = fs::path(o.output).lexically_normal().string();
  if (fs::exists(out, ec) && !o.force) {
    return absl::AlreadyExistsError(absl::StrCat(out, " exists (use --force to replace it)"));
  }
  const std::string partial = out + ".partial";
  fs::remove_all(partial, ec);
  fs::create_directories(partial, ec);
  if (ec)
    return absl::UnavailableError(absl::StrCat("cannot create ", partial, ": ", ec.message()));

  const int width = tokenizer->vocab_size() <= 65536 ? 2 : 4;
  SplitWriter train, validation;
  RETURN_IF_ERROR(train.Open(partial, "train", width));
  RETURN_IF_ERROR(validation.Open(partial, "validation", width));

  v1::DatasetManifest m;
  m.set_format(kDatasetFormat);
  m.set_tokenizer_kind(tokenizer->kind());
  m.set_tokenizer_checksum(tokenizer->checksum());
  m.set_vocab_size(static_cast<uint32_t>(tokenizer->vocab_size()));
  m.set_token_bytes(static_cast<uint32_t>(width));
  m.set_eos_id(tokenizer->eos_id());
  m.set_validation_fraction(o.validation_fraction);
  m.set_split_seed(o.split_seed);

  PrepareProgress progress;
  progress.bytes_total = reader->bytes_total();
  auto last = std::chrono::steady_clock::now();
  auto report = [&](bool force) {
    if (!o.progress) return;
    const auto now = std::chrono::steady_clock::now();
    if (!force && now - last < std::chrono::milliseconds(250)) return;
    last = now;
    o.progress(progress);
  };
  uint64_t doc_index = 0;
  std::string text, where;
  for (;;) {
    ASSIGN_OR_RETURN(bool more, reader->Next(&text, &where));
    progress.bytes_done = reader->bytes_done();
    if (!more) break;
    absl::StatusOr<std::vector<int32_t>> encoded = tokenizer->Encode(text);
    if (!encoded.ok()) {
      return absl::Status(encoded.status().code(),
                          absl::StrCat(where, ": ", encoded.status().message()));
    }
    std::vector<int32_t> ids = *std::move(encoded);
    if (tokenizer->eos_id() >= 0) {
      ids.push_back(tokenizer->eos_id());
    } else {
      ids.push_back('\n');  // the byte tokenizer: a blank line between documents
    }
    SplitWriter& w =
        InValidation(o.split_seed, doc_index++, o.validation_fraction) ? validation : train;
    RETURN_IF_ERROR(w.Add(ids));
    progress.tokens += ids.size();
    ++progress.documents;
    if (train.num_tokens + validation.num_tokens > DatasetLimits::kMaxTokens ||
        progress.documents > DatasetLimits::kMaxDocuments) {
      return absl::ResourceExhaustedError("the dataset exceeds the token or document limit");
    }
    report(false);
  }
  for (const InputSource& in : reader->sources()) {
    m.set_text_bytes(m.text_bytes() + in.bytes);
    v1::DatasetManifest::Source* src = m.add_sources();
    src->set_path(in.path);
    src->set_bytes(in.bytes);
    src->set_documents(in.documents);
  }
  report(true);
  RETURN_IF_ERROR(train.Close());
  RETURN_IF_ERROR(validation.Close());
  if (train.documents == 0) {
    return absl::FailedPreconditionError("the inputs hold no text");
  }
  if (o.validation_fraction > 0 && validation.documents == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("none of the ", train.documents,
                     " documents fell into the validation split of ", o.validation_fraction,
                     "; use more documents (--documents paragraphs or lines) or a "
                     "larger fraction"));
  }
  train.Describe("train", m.mutable_train());
  validation.Describe("validation", m.mutable_validation());
  if (tokenizer->kind() != "byte") {
    m.set_tokenizer_file(kTokenizerFile);
    RETURN_IF_ERROR(
        WriteFileAtomically(absl::StrCat(partial, "/", kTokenizerFile), tokenizer->serialized()));
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions jo;
  jo.add_whitespace = true;
  jo.preserve_proto_field_names = true;
  jo.always_print_primitive_fields = true;
  if (!google::protobuf::util::MessageToJsonString(m, &json, jo).ok()) {
    return absl::InternalError("cannot print the dataset manifest");
  }
  RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(partial, "/", kManifest), json));
  RETURN_IF_ERROR(SyncDirectory(partial));
  if (fs::exists(out, ec)) fs::remove_all(out, ec);
  fs::rename(partial, out, ec);
  if (ec)
    return absl::UnavailableError(
        absl::StrCat("cannot rename ", partial, " to ", out, ": ", ec.message()));
  const fs::path parent = fs::path(out).parent_path();
  RETURN_IF_ERROR(SyncDirectory(parent.empty() ? "." : parent.string()));
  return m;
}

absl::StatusOr<std::string> TrainTokenizerOnInputs(const SentencePieceTraining& options,
                                                   const std::vector<std::string>& inputs,
                                                   const std::string& jsonl_field,
                                                   const std::string& scratch,
                                                   TokenizerCorpus* corpus) {
  ASSIGN_OR_RETURN(std::unique_ptr<DocumentReader> reader,
                   DocumentReader::Open(inputs, TextDocuments::kLines, jsonl_field));
  TokenizerCorpus seen;
  std::string doc, where;
  size_t pos = 0;  // next line of `doc`
  auto next_line = [&](std::string* line) -> absl::StatusOr<bool> {
    while (options.max_sentences <= 0 || seen.lines < options.max_sentences) {
      if (pos >= doc.size()) {
        ASSIGN_OR_RETURN(bool more, reader->Next(&doc, &where));
        if (!more) return false;
        pos = 0;
      }
      size_t end = doc.find('\n', pos);
      if (end == std::string::npos) end = doc.size();
      line->assign(doc, pos, end - pos);
      pos = end + 1;
      if (line->empty()) continue;
      ++seen.lines;
      seen.bytes += line->size();
      return true;
    }
    return false;
  };
  // The first line before spm_train starts: inputs without text are ours to
  // name, not spm_train's.
  std::string first;
  ASSIGN_OR_RETURN(bool any, next_line(&first));
  if (!any) return absl::FailedPreconditionError("the inputs hold no text");
  bool first_pending = true;
  auto feed = [&](std::string* line) -> absl::StatusOr<bool> {
    if (first_pending) {
      first_pending = false;
      line->swap(first);
      return true;
    }
    return next_line(line);
  };
  absl::StatusOr<std::string> model = TrainSentencePieceOnLines(options, feed, scratch);
  if (corpus != nullptr) *corpus = seen;
  return model;
}

namespace {

absl::Status Bad(const std::string& path, const std::string& what) {
  return absl::DataLossError(absl::StrCat(path, ": ", what));
}

struct MappedSplit {
  std::shared_ptr<const MappedFile> tokens;
  std::vector<uint64_t> documents;
};

absl::StatusOr<MappedSplit> OpenSplit(const std::string& dir, const std::string& what,
                                      const v1::DatasetManifest& m,
                                      const v1::DatasetManifest::Split& s, bool verify) {
  const std::string mpath = absl::StrCat(dir, "/", kManifest);
  if (!SafeName(s.tokens_file()) || !SafeName(s.index_file())) {
    return Bad(mpath, absl::StrCat(what, ": file names must be plain names inside the dataset"));
  }
  if (s.tokens() > DatasetLimits::kMaxTokens || s.documents() > DatasetLimits::kMaxDocuments) {
    return Bad(mpath, absl::StrCat(what, ": ", s.tokens(), " tokens / ", s.documents(),
                                   " documents exceed the limits"));
  }
  MappedSplit out;
  ASSIGN_OR_RETURN(out.tokens, MappedFile::Open(absl::StrCat(dir, "/", s.tokens_file())));
  if (out.tokens->size() != s.tokens() * m.token_bytes()) {
    return Bad(out.tokens->path(),
               absl::StrCat(out.tokens->size(), " bytes, the manifest says ", s.tokens(),
                            " tokens of ", m.token_bytes(), " bytes (truncated or replaced?)"));
  }
  ASSIGN_OR_RETURN(auto index, MappedFile::Open(absl::StrCat(dir, "/", s.index_file())));
  if (index->size() != (s.documents() + 1) * 8) {
    return Bad(index->path(),
               absl::StrCat(index->size(), " bytes, the manifest says ", s.documents(),
                            " documents (", (s.documents() + 1) * 8, " bytes)"));
  }
  out.documents.resize(s.documents() + 1);
  if (index->size() > 0) std::memcpy(out.documents.data(), index->data(), index->size());
  if (out.documents.front() != 0 || out.documents.back() != s.tokens()) {
    return Bad(index->path(), "does not start at 0 and end at the token count");
  }
  for (size_t i = 1; i < out.documents.size(); ++i) {
    if (out.documents[i] < out.documents[i - 1]) {
      return Bad(index->path(), absl::StrCat("document ", i - 1, " ends before it starts"));
    }
  }
  if (verify) {
    Fnv1a64 fi;
    fi.Add(absl::string_view(reinterpret_cast<const char*>(index->data()), index->size()));
    if (fi.Hex() != s.index_checksum()) {
      return Bad(index->path(), absl::StrCat("checksum ", fi.Hex(), " is not the manifest's ",
                                             s.index_checksum()));
    }
    Fnv1a64 ft;
    ft.Add(
        absl::string_view(reinterpret_cast<const char*>(out.tokens->data()), out.tokens->size()));
    if (ft.Hex() != s.tokens_checksum()) {
      return Bad(out.tokens->path(), absl::StrCat("checksum ", ft.Hex(), " is not the manifest's ",
                                                  s.tokens_checksum()));
    }
    const TokenSequence seq =
        TokenSequence::View(out.tokens, out.tokens->data(), static_cast<int64_t>(s.tokens()),
                            static_cast<int>(m.token_bytes()));
    for (int64_t i = 0; i < seq.size(); ++i) {
      if (static_cast<uint32_t>(seq[i]) >= m.vocab_size()) {
        return Bad(out.tokens->path(),
                   absl::StrCat("token ", i, " is id ", static_cast<uint32_t>(seq[i]),
                                ", outside the vocabulary of ", m.vocab_size()));
      }
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<v1::DatasetManifest> ParseDatasetManifest(const std::string& dir,
                                                         std::string* checksum) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("dataset ", dir, ": no such directory"));
  }
  const std::string mpath = absl::StrCat(dir, "/", kManifest);
  ASSIGN_OR_RETURN(std::string json, ReadFileBounded(mpath, DatasetLimits::kMaxManifestBytes));
  if (checksum != nullptr) *checksum = Checksum(json);
  v1::DatasetManifest m;
  google::protobuf::util::JsonParseOptions po;  // unknown fields are errors
  if (auto st = google::protobuf::util::JsonStringToMessage(json, &m, po); !st.ok()) {
    return Bad(mpath, absl::StrCat("not a dataset manifest (", std::string(st.message()), ")"));
  }
  return m;
}

absl::StatusOr<v1::DatasetManifest> ReadDatasetManifest(const std::string& dir) {
  return ParseDatasetManifest(dir, nullptr);
}

DataProvenance ProvenanceOf(const v1::DataSpec& data) {
  DataProvenance p;
  p.source = data.source() == v1::DATA_SOURCE_SHARDS ? "shards"
             : data.source() == v1::DATA_SOURCE_TEXT ? "text"
                                                     : "embedded";
  p.path = data.path();
  p.tokenizer = data.tokenizer();
  p.validation_fraction = data.validation_fraction();
  if (!data.tokenizer().empty()) {
    if (auto t = Tokenizer::Load(data.tokenizer()); t.ok()) p.tokenizer_checksum = (*t)->checksum();
  } else if (data.source() == v1::DATA_SOURCE_SHARDS) {
    if (auto m = ReadDatasetManifest(data.path()); m.ok()) {
      p.tokenizer_checksum = m->tokenizer_checksum();
      p.validation_fraction = m->validation_fraction();
    }
  } else {
    p.tokenizer_checksum = "byte";
  }
  return p;
}

v1::DataSpec DataSpecOf(const DataProvenance& p) {
  v1::DataSpec d;
  d.set_source(p.source == "shards" ? v1::DATA_SOURCE_SHARDS
               : p.source == "text" ? v1::DATA_SOURCE_TEXT
                                    : v1::DATA_SOURCE_EMBEDDED);
  d.set_path(p.path);
  d.set_tokenizer(p.tokenizer);
  d.set_validation_fraction(p.source == "shards" ? 0 : p.validation_fraction);
  return d;
}

absl::StatusOr<ShardDataset> OpenShardDataset(const std::string& dir, bool verify) {
  const std::string mpath = absl::StrCat(dir, "/", kManifest);
  ShardDataset ds;
  ASSIGN_OR_RETURN(ds.manifest, ParseDatasetManifest(dir, &ds.manifest_checksum));
  v1::DatasetManifest& m = ds.manifest;
  if (m.format() != kDatasetFormat) {
    return absl::FailedPreconditionError(
        absl::StrCat(mpath, ": format \"", m.format(), "\", this build reads ", kDatasetFormat));
  }
  if (m.token_bytes() != 2 && m.token_bytes() != 4) {
    return Bad(mpath, absl::StrCat("token_bytes ", m.token_bytes(), " is not 2 or 4"));
  }
  if (m.vocab_size() < 1 || m.vocab_size() > static_cast<uint32_t>(kMaxVocabSize) ||
      (m.token_bytes() == 2 && m.vocab_size() > 65536)) {
    return Bad(mpath, absl::StrCat("vocab_size ", m.vocab_size(), " is out of range for ",
                                   m.token_bytes(), "-byte tokens"));
  }
  if (m.eos_id() < -1 || m.eos_id() >= static_cast<int64_t>(m.vocab_size())) {
    return Bad(mpath, absl::StrCat("eos_id ", m.eos_id(), " is outside the vocabulary"));
  }
  if (!(m.validation_fraction() >= 0 && m.validation_fraction() <= 0.5)) {
    return Bad(mpath, "validation_fraction is outside [0, 0.5]");
  }
  if (m.tokenizer_kind() == "byte") {
    if (m.tokenizer_checksum() != "byte" || m.vocab_size() != 256) {
      return Bad(mpath, "a byte-tokenizer dataset must have checksum \"byte\" and vocabulary 256");
    }
  } else if (m.tokenizer_kind() == "sentencepiece") {
    if (!SafeName(m.tokenizer_file())) {
      return Bad(mpath, "tokenizer_file must be a plain name inside the dataset");
    }
    if (verify) {
      ASSIGN_OR_RETURN(auto tok, Tokenizer::Load(absl::StrCat(dir, "/", m.tokenizer_file())));
      if (tok->checksum() != m.tokenizer_checksum() ||
          static_cast<uint32_t>(tok->vocab_size()) != m.vocab_size()) {
        return Bad(mpath, absl::StrCat("the tokenizer file (", tok->checksum(), ", vocabulary ",
                                       tok->vocab_size(), ") is not the one the manifest names (",
                                       m.tokenizer_checksum(), ", ", m.vocab_size(), ")"));
      }
    }
  } else {
    return Bad(mpath, absl::StrCat("tokenizer_kind \"", m.tokenizer_kind(),
                                   "\" is not byte or sentencepiece"));
  }
  ASSIGN_OR_RETURN(MappedSplit train, OpenSplit(dir, "train", m, m.train(), verify));
  ASSIGN_OR_RETURN(MappedSplit validation, OpenSplit(dir, "validation", m, m.validation(), verify));
  const int width = static_cast<int>(m.token_bytes());
  ds.train = TokenSequence::View(train.tokens, train.tokens->data(),
                                 static_cast<int64_t>(m.train().tokens()), width);
  ds.validation = TokenSequence::View(validation.tokens, validation.tokens->data(),
                                      static_cast<int64_t>(m.validation().tokens()), width);
  ds.train_documents = std::move(train.documents);
  ds.validation_documents = std::move(validation.documents);
  return ds;
}

absl::StatusOr<TextDataset> LoadShardDataset(const v1::DataSpec& data) {
  if (data.path().empty()) {
    return absl::InvalidArgumentError("data.path: required when data.source is DATA_SOURCE_SHARDS");
  }
  ASSIGN_OR_RETURN(ShardDataset ds, OpenShardDataset(data.path()));
  if (!data.tokenizer().empty()) {
    ASSIGN_OR_RETURN(auto tok, Tokenizer::Load(data.tokenizer()));
    if (tok->checksum() != ds.manifest.tokenizer_checksum()) {
      return absl::FailedPreconditionError(
          absl::StrCat("data.tokenizer ", data.tokenizer(), " (", tok->checksum(),
                       ") is not the tokenizer dataset ", data.path(), " was prepared with (",
                       ds.manifest.tokenizer_checksum(), ")"));
    }
  }
  if (data.validation_fraction() > 0 &&
      std::fabs(data.validation_fraction() - ds.manifest.validation_fraction()) > 1e-12) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.validation_fraction ", data.validation_fraction(), " differs from dataset ",
        data.path(), "'s split (", ds.manifest.validation_fraction(),
        ", fixed by detour-data prepare); leave it unset"));
  }
  TextDataset out;
  out.train = ds.train;
  out.validation = ds.validation;
  out.tokenizer_checksum = ds.manifest.tokenizer_checksum();
  out.vocab_size = static_cast<int>(ds.manifest.vocab_size());
  out.dataset_checksum = ds.manifest_checksum;
  return out;
}

}  // namespace detour::model
