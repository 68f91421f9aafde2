#include "worker/model/tokenizer.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <limits>
#include <optional>
#include <queue>
#include <unordered_map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/files.h"
#include "common/status.h"
#include "common/subprocess.h"
#include "detour/spm/model.pb.h"
#include "worker/model/byte_tokenizer.h"
#include "common/checkpoint_manifest.h"

namespace detour::model {

namespace {
constexpr char kSpace[] = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space
constexpr size_t kMaxPieceBytes = 1024;
using Piece = spm::ModelProto::SentencePiece;

size_t Utf8Length(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;  // a stray byte stands alone
}
}  // namespace

// A SentencePiece model as detour uses it: pieces, scores and types, the
// lookup from piece text to id, and the normaliser's switches.
struct SentencePieceModel {
  bool bpe = true;
  std::vector<std::string> pieces;
  std::vector<float> scores;
  std::vector<int> types;
  std::unordered_map<std::string, int> index;  // NORMAL and USER_DEFINED pieces
  std::vector<std::string> user_defined;       // longest first
  std::array<int, 256> byte_ids{};
  bool byte_fallback = false;
  int unk_id = -1;
  int eos_id = -1;
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
  bool escape_whitespaces = true;
  size_t max_piece_bytes = 1;
  float min_score = 0;

  std::string Normalize(absl::string_view text) const {
    std::string t;
    if (remove_extra_whitespaces) {
      bool space = true;  // drops leading spaces
      for (char c : text) {
        if (c == ' ') {
          if (!space) t.push_back(' ');
          space = true;
        } else {
          t.push_back(c);
          space = false;
        }
      }
      while (!t.empty() && t.back() == ' ') t.pop_back();
    } else {
      t.assign(text.data(), text.size());
    }
    if (add_dummy_prefix && !t.empty()) t.insert(t.begin(), ' ');
    if (!escape_whitespaces) return t;
    std::string out;
    out.reserve(t.size() + t.size() / 4);
    for (char c : t) {
      if (c == ' ') {
        out += kSpace;
      } else {
        out.push_back(c);
      }
    }
    return out;
  }

  // Initial symbols: user-defined pieces (longest match) and characters.
  std::vector<std::pair<size_t, size_t>> Symbols(const std::string& s) const {
    std::vector<std::pair<size_t, size_t>> out;
    size_t i = 0;
    while (i < s.size()) {
      size_t len = 0;
      for (const std::string& u : user_defined) {
        if (s.compare(i, u.size(), u) == 0) {
          len = u.size();
          break;
        }
      }
      if (len == 0) len = std::min(Utf8Length(static_cast<unsigned char>(s[i])), s.size() - i);
      out.push_back({i, len});
      i += len;
    }
    return out;
  }

  int Lookup(const std::string& s, size_t begin, size_t len) const {
    auto it = index.find(s.substr(begin, len));
    return it == index.end() ? -1 : it->second;
  }

  // Ids of one symbol that may not be a piece: itself, its bytes, or unk.
  void Emit(const std::string& s, size_t begin, size_t len, int id,
            std::vector<int32_t>* out) const {
    if (id >= 0) {
      out->push_back(id);
      return;
    }
    if (byte_fallback) {
      for (size_t k = 0; k < len; ++k)
        out->push_back(byte_ids[static_cast<unsigned char>(s[begin + k])]);
      return;
    }
    // Consecutive unknowns become one, as SentencePiece does.
    if (out->empty() || out->back() != unk_id) out->push_back(unk_id);
  }

  void EncodeBpe(const std::string& s, std::vector<int32_t>* out) const {
    struct Sym {
      size_t begin, len;
      int prev, next;
      bool frozen;
    };
    std::vector<Sym> syms;
    for (auto [b, l] : Symbols(s)) {
      const int id = Lookup(s, b, l);
      const bool frozen = id >= 0 && types[id] == Piece::USER_DEFINED;
      syms.push_back(
          {b, l, static_cast<int>(syms.size()) - 1, static_cast<int>(syms.size()) + 1, frozen});
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    struct Pair {
      float score;
      int left, right;
      size_t len;  // merged length, to notice stale entries
    };
    auto worse = [](const Pair& a, const Pair& b) {
      if (a.score != b.score) return a.score < b.score;
      return a.left > b.left;
    };
    std::priority_queue<Pair, std::vector<Pair>, decltype(worse)> agenda(worse);
    auto consider = [&](int l, int r) {
      if (l < 0 || r < 0 || syms[l].frozen || syms[r].frozen) return;
      const size_t len = syms[l].len + syms[r].len;
      if (len > max_piece_bytes) return;
      const int id = Lookup(s, syms[l].begin, len);
      if (id < 0 || types[id] != Piece::NORMAL) return;
      agenda.push({scores[id], l, r, len});
    };
    for (size_t i = 0; i + 1 < syms.size(); ++i)
      consider(static_cast<int>(i), static_cast<int>(i) + 1);
    while (!agenda.empty()) {
      const Pair p = agenda.top();
      agenda.pop();
      Sym& l = syms[p.left];
      if (l.len == 0 || l.next != p.right || syms[p.right].len == 0 ||
          l.len + syms[p.right].len != p.len) {
        continue;  // stale
      }
      Sym& r = syms[p.right];
      l.len += r.len;
      r.len = 0;
      l.next = r.next;
      if (r.next >= 0) syms[r.next].prev = p.left;
      consider(l.prev, p.left);
      consider(p.left, l.next);
    }
    for (int i = 0; i >= 0; i = syms[i].next) {
      Emit(s, syms[i].begin, syms[i].len, Lookup(s, syms[i].begin, syms[i].len), out);
    }
  }

  void EncodeUnigram(const std::string& s, std::vector<int32_t>* out) const {
    // Viterbi over character boundaries; an uncovered character is an
    // unknown piece scored min_score - 10, as SentencePiece does.
    const size_t n = s.size();
    constexpr double kNone = -std::numeric_limits<double>::infinity();
    std::vector<double> best(n + 1, kNone);
    std::vector<size_t> from(n + 1, 0);
    std::vector<int> via(n + 1, -1);
    best[0] = 0;
    for (size_t i = 0; i < n;) {
      const size_t ch = std::min(Utf8Length(static_cast<unsigned char>(s[i])), n - i);
      if (best[i] != kNone) {
        bool single = false;
        for (size_t len = 1; len <= max_piece_bytes && i + len <= n; ++len) {
          const int id = Lookup(s, i, len);
          if (id < 0 || types[id] == Piece::UNUSED) continue;
          const double score = types[id] == Piece::USER_DEFINED ? 0.0 : scores[id];
          if (len == ch) single = true;
          if (best[i] + score > best[i + len]) {
            best[i + len] = best[i] + score;
            from[i + len] = i;
            via[i + len] = id;
          }
        }
        if (!single && best[i] + min_score - 10 > best[i + ch]) {
          best[i + ch] = best[i] + min_score - 10;
          from[i + ch] = i;
          via[i + ch] = -1;
        }
      }
      i += ch;
    }
    std::vector<std::pair<size_t, int>> path;  // (begin, id) backwards
    for (size_t e = n; e > 0; e = from[e]) path.push_back({from[e], via[e]});
    std::reverse(path.begin(), path.end());
    for (size_t k = 0; k < path.size(); ++k) {
      const size_t b = path[k].first;
      const size_t e = k + 1 < path.size() ? path[k + 1].first : n;
      Emit(s, b, e - b, path[k].second, out);
    }
  }
};

Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::Byte() {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->kind_ = "byte";
  t->vocab_size_ = ByteTokenizer::kVocabSize;
  t->checksum_ = "byte";
  return t;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromSentencePiece(std::string serialized,
                                                                        absl::string_view what) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", why));
  };
  if (serialized.size() > kMaxTokenizerFileBytes) {
    return bad(
        absl::StrCat(serialized.size(), " bytes, more than the limit ", kMaxTokenizerFileBytes));
  }
  spm::ModelProto proto;
  if (!proto.ParseFromString(serialized)) return bad("not a SentencePiece model (unparsable)");
  const int n = proto.pieces_size();
  if (n < 1 || n > kMaxVocabSize) {
    return bad(absl::StrCat("vocabulary of ", n, " pieces is outside [1, ", kMaxVocabSize, "]"));
  }
  const auto& trainer = proto.trainer_spec();
  if (trainer.model_type() != spm::ModelProto::TrainerSpec::BPE &&
      trainer.model_type() != spm::ModelProto::TrainerSpec::UNIGRAM) {
    return absl::UnimplementedError(absl::StrCat(
        what, ": model type ", spm::ModelProto::TrainerSpec::ModelType_Name(trainer.model_type()),
        " (only BPE and unigram models are supported)"));
  }
  const auto& norm = proto.normalizer_spec();
  if (!norm.precompiled_charsmap().empty() && norm.name() != "identity") {
    return absl::UnimplementedError(absl::StrCat(
        what, ": normaliser \"", norm.name(),
        "\" is not supported (only \"identity\", as LLaMA's and detour-data's models use)"));
  }
  auto m = std::make_shared<SentencePieceModel>();
  m->bpe = trainer.model_type() == spm::ModelProto::TrainerSpec::BPE;
  m->byte_fallback = trainer.byte_fallback();
  m->add_dummy_prefix = norm.add_dummy_prefix();
  m->remove_extra_whitespaces = norm.remove_extra_whitespaces();
  m->escape_whitespaces = norm.escape_whitespaces();
  m->byte_ids.fill(-1);
  m->min_score = std::numeric_limits<float>::max();
  for (int i = 0; i < n; ++i) {
    const Piece& p = proto.pieces(i);
    if (p.piece().empty() || p.piece().size() > kMaxPieceBytes) {
      return bad(absl::StrCat("piece ", i, " is empty or longer than ", kMaxPieceBytes, " bytes"));
    }
    if (!std::isfinite(p.score())) return bad(absl::StrCat("piece ", i, " has a non-finite score"));
    m->pieces.push_back(p.piece());
    m->scores.push_back(p.score());
    m->types.push_back(p.type());
    switch (p.type()) {
      case Piece::NORMAL:
      case Piece::USER_DEFINED:
      case Piece::UNUSED:
        if (!m->index.emplace(p.piece(), i).second) {
          return bad(absl::StrCat("piece ", i, " \"", p.piece(), "\" appears twice"));
        }
        if (p.type() == Piece::USER_DEFINED) m->user_defined.push_back(p.piece());
        if (p.type() == Piece::NORMAL) m->min_score = std::min(m->min_score, p.score());
        m->max_piece_bytes = std::max(m->max_piece_bytes, p.piece().size());
        break;
      case Piece::BYTE: {
        unsigned v = 0;
        if (p.piece().size() != 6 || !absl::StartsWith(p.piece(), "<0x") || p.piece()[5] != '>' ||
            !absl::SimpleHexAtoi(p.piece().substr(3, 2), &v) || v > 255) {
          return bad(absl::StrCat("byte piece ", i, " \"", p.piece(), "\" is not <0xHH>"));
        }
        m->byte_ids[v] = i;
        break;
      }
      case Piece::UNKNOWN: m->unk_id = i; break;
      default: break;
    }
  }
  if (m->min_score == std::numeric_limits<float>::max()) m->min_score = 0;
  std::sort(m->user_defined.begin(), m->user_defined.end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  if (m->byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      if (m->byte_ids[b] < 0)
        return bad(absl::StrFormat("byte fallback without piece <0x%02X>", b));
    }
  } else if (m->unk_id < 0) {
    return bad("no unknown piece and no byte fallback");
  }
  m->eos_id = trainer.eos_id() >= 0 && trainer.eos_id() < n ? trainer.eos_id() : -1;
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->kind_ = "sentencepiece";
  t->vocab_size_ = n;
  t->eos_id_ = m->eos_id;
  t->checksum_ = Checksum(serialized);
  t->serialized_ = std::move(serialized);
  t->model_ = std::move(m);
  return t;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  if (path.empty()) return Byte();
  auto bytes = ReadFileBounded(path, kMaxTokenizerFileBytes);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(),
                        absl::StrCat("tokenizer: ", bytes.status().message()));
  }
  return FromSentencePiece(*std::move(bytes), absl::StrCat("tokenizer ", path));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(absl::string_view text) const {
  if (!model_) return ByteTokenizer::Encode(text);
  // Long text in pieces of about kPiece bytes, cut after a newline where
  // there is one (else at a character boundary), so the work stays linear.
  constexpr size_t kPiece = 1 << 16;
  std::vector<int32_t> out;
  bool first = true;
  while (!text.empty()) {
    size_t n = text.size();
    if (n > kPiece) {
      const size_t nl = text.rfind('\n', kPiece);
      n = nl != absl::string_view::npos && nl > 0 ? nl + 1 : kPiece;
      while (n < text.size() && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) ++n;
    }
    // The dummy prefix belongs to the start of the text only.
    std::string s = model_->Normalize(text.substr(0, n));
    if (!first && model_->add_dummy_prefix && absl::StartsWith(s, kSpace)) s.erase(0, 3);
    if (model_->bpe) {
      model_->EncodeBpe(s, &out);
    } else {
      model_->EncodeUnigram(s, &out);
    }
    first = false;
    text.remove_prefix(n);
  }
  return out;
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int32_t> ids) const {
  if (!model_) return ByteTokenizer::Decode(ids);
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", i, ": id ", ids[i], " is outside [0, ", vocab_size_, ")"));
    }
    const int id = ids[i];
    switch (model_->types[id]) {
      case Piece::CONTROL: break;
      case Piece::BYTE: {
        unsigned v = 0;
        if (absl::SimpleHexAtoi(model_->pieces[id].substr(3, 2), &v))
          text.push_back(static_cast<char>(v));
        break;
      }
      case Piece::UNKNOWN:
        text += " \xE2\x81\x87 ";  // " ⁇ ", as SentencePiece decodes unknowns
        break;
      default: text += model_->pieces[id];
    }
  }
  if (model_->escape_whitespaces) {
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      if (text.compare(i, 3, kSpace) == 0) {
        out.push_back(' ');
        i += 3;
      } else {
        out.push_back(text[i++]);
      }
    }
    text = std::move(out);
  }
  if (model_->add_dummy_prefix && !text.empty() && text[0] == ' ') text.erase(0, 1);
  return text;
}

namespace {

absl::Status CheckTraining(const SentencePieceTraining& options) {
  if (options.model_type != "bpe" && options.model_type != "unigram") {
    return absl::InvalidArgumentError(
        absl::StrCat("model type \"", options.model_type, "\" is not bpe or unigram"));
  }
  if (options.vocab_size < kMinTrainedVocab || options.vocab_size > kMaxVocabSize) {
    return absl::InvalidArgumentError(absl::StrCat("vocabulary size ", options.vocab_size,
                                                   " is outside [", kMinTrainedVocab, ", ",
                                                   kMaxVocabSize, "]"));
  }
  if (!(options.character_coverage > 0 && options.character_coverage <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("character coverage ", options.character_coverage, " is outside (0, 1]"));
  }
  if (options.num_threads < 1 || options.num_threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads ", options.num_threads, " is outside [1, 1024]"));
  }
  if (::access(options.spm_train.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(options.spm_train,
                     " is missing: install Debian's `sentencepiece` package "
                     "(tools/install_deps.sh)"));
  }
  return absl::OkStatus();
}

// spm_train's command line: the settings DATA.md documents (exact round
// trips, LLaMA's special ids).
std::vector<std::string> SpmTrainArgs(const SentencePieceTraining& options,
                                      const std::string& input, const std::string& prefix) {
  return {
      options.spm_train,
      "--input=" + input,
      "--model_prefix=" + prefix,
      absl::StrCat("--vocab_size=", options.vocab_size),
      "--model_type=" + options.model_type,
      absl::StrCat("--character_coverage=", options.character_coverage),
      absl::StrCat("--num_threads=", options.num_threads),
      absl::StrCat("--input_sentence_size=", std::max<int64_t>(0, options.max_sentences)),
      "--shuffle_input_sentence=false",
      "--max_sentence_length=16384",
      "--byte_fallback=true",
      "--normalization_rule_name=identity",
      "--remove_extra_whitespaces=false",
      "--add_dummy_prefix=false",
      "--split_digits=true",
      "--allow_whitespace_only_pieces=true",
      "--unk_id=0",
      "--bos_id=1",
      "--eos_id=2",
      "--pad_id=-1",
      "--hard_vocab_limit=false",
  };
}

// Waits for a started spm_train and reads the model it wrote at `model`.
absl::StatusOr<std::string> FinishSpmTrain(ChildProcess* child, const std::string& model) {
  const std::optional<int> rc = child->Wait(absl::Hours(24));
  if (!rc.has_value() || *rc != 0) {
    std::string text = child->Log();
    if (text.size() > 2000) text = "..." + text.substr(text.size() - 2000);
    return absl::FailedPreconditionError(
        absl::StrCat("spm_train failed (exit ", rc.value_or(-1), "): ", text));
  }
  return ReadFileBounded(model, kMaxTokenizerFileBytes);
}

}  // namespace

absl::StatusOr<std::string> TrainSentencePiece(const SentencePieceTraining& options,
                                               const std::string& input) {
  RETURN_IF_ERROR(CheckTraining(options));
  std::error_code ec;
  const std::string dir = absl::StrCat(input, ".spm-", ::getpid());
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  const std::string prefix = dir + "/m";
  ChildProcess child;
  const absl::Status started =
      child.Start(SpmTrainArgs(options, input, prefix), dir + "/spm_train.log");
  absl::StatusOr<std::string> result =
      started.ok() ? FinishSpmTrain(&child, prefix + ".model") : started;
  std::filesystem::remove_all(dir, ec);
  return result;
}

absl::StatusOr<std::string> TrainSentencePieceOnLines(
    const SentencePieceTraining& options,
    const std::function<absl::StatusOr<bool>(std::string* line)>& next_line,
    const std::string& scratch) {
  RETURN_IF_ERROR(CheckTraining(options));
  std::error_code ec;
  if (std::filesystem::exists(scratch, ec)) {
    return absl::AlreadyExistsError(absl::StrCat(scratch, " exists"));
  }
  std::filesystem::create_directories(scratch, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot create ", scratch, ": ", ec.message()));
  }
  // Relative names inside the scratch directory: the model records them,
  // and they are the same on every run.
  ChildProcess child;
  absl::Status status = child.StartWithInput(SpmTrainArgs(options, "/dev/stdin", "m"),
                                             scratch + "/spm_train.log", scratch);
  std::string buffer, line;
  constexpr size_t kChunk = 1 << 20;
  while (status.ok()) {
    absl::StatusOr<bool> more = next_line(&line);
    if (!more.ok()) {
      status = more.status();
      child.Stop(absl::Seconds(5));
      break;
    }
    if (*more) {
      buffer += line;
      buffer += '\n';
    }
    if (!buffer.empty() && (!*more || buffer.size() >= kChunk)) {
      // A child that stopped reading has failed: its log says why.
      if (!child.WriteInput(buffer).ok()) break;
      buffer.clear();
    }
    if (!*more) break;
  }
  child.CloseInput();
  absl::StatusOr<std::string> result =
      status.ok() ? FinishSpmTrain(&child, scratch + "/m.model") : status;
  std::filesystem::remove_all(scratch, ec);
  return result;
}

}  // namespace detour::model
