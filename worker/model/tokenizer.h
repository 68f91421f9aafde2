// Tokenizers a job can use: the byte tokenizer (zero setup, vocabulary 256)
// or a SentencePiece model (BPE or unigram, trained with `detour-data
// tokenizer` or any existing .model file with the identity normaliser, such
// as LLaMA's). Encoding and decoding are detour's own (the model file is read
// with our own description of its format, proto/detour/spm/model.proto);
// only training runs Debian's `spm_train`. No LibTorch. A Tokenizer is
// immutable after loading and thread-safe.
#ifndef DETOUR_WORKER_MODEL_TOKENIZER_H_
#define DETOUR_WORKER_MODEL_TOKENIZER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace detour::model {

struct SentencePieceModel;  // tokenizer.cc

// Most bytes of a tokenizer model file.
inline constexpr uint64_t kMaxTokenizerFileBytes = uint64_t{64} << 20;
// Largest vocabulary accepted (ids must fit the model's embedding).
inline constexpr int kMaxVocabSize = 1 << 20;

class Tokenizer {
 public:
  ~Tokenizer();

  // The byte tokenizer.
  static std::unique_ptr<Tokenizer> Byte();
  // A SentencePiece model from its serialized bytes; INVALID_ARGUMENT naming
  // `what` when they are not a model or the vocabulary is out of bounds.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromSentencePiece(std::string serialized,
                                                                      absl::string_view what);
  // "" → the byte tokenizer; otherwise a SentencePiece .model file (at most
  // kMaxTokenizerFileBytes). NOT_FOUND for a missing file.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);

  // "byte" or "sentencepiece".
  const std::string& kind() const { return kind_; }
  int vocab_size() const { return vocab_size_; }
  // End-of-document token, -1 for none (the byte tokenizer).
  int eos_id() const { return eos_id_; }
  // "byte", or "fnv1a64:<hex>" of the model bytes: two tokenizers with the
  // same checksum give the same ids.
  const std::string& checksum() const { return checksum_; }
  // The serialized model ("" for the byte tokenizer).
  const std::string& serialized() const { return serialized_; }

  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const;
  // INVALID_ARGUMENT naming the first id outside [0, vocab_size).
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids) const;

 private:
  Tokenizer() = default;
  std::string kind_;
  int vocab_size_ = 0;
  int eos_id_ = -1;
  std::string checksum_;
  std::string serialized_;
  std::shared_ptr<const SentencePieceModel> model_;
};

struct SentencePieceTraining {
  std::string model_type = "bpe";  // "bpe" or "unigram"
  int vocab_size = 8000;           // in [kMinTrainedVocab, kMaxVocabSize]
  double character_coverage = 0.9995;
  int num_threads = 1;
  int64_t max_sentences = 2000000;               // lines used for training at most
  std::string spm_train = "/usr/bin/spm_train";  // Debian package `sentencepiece`
};
inline constexpr int kMinTrainedVocab = 260;  // 256 byte pieces + specials

// Trains a SentencePiece model with `spm_train` on `input` (a text file, one
// training sentence per line) and returns the model's bytes. The model uses
// byte fallback (no unknown characters), the identity normaliser, keeps
// whitespace and adds no dummy prefix, so Decode(Encode(text)) == text for
// any UTF-8 text and text encoded in pieces gives the same ids as the whole.
// INVALID_ARGUMENT for bad options (naming the option), FAILED_PRECONDITION
// when spm_train is missing or fails (its log is quoted).
absl::StatusOr<std::string> TrainSentencePiece(const SentencePieceTraining& options,
                                               const std::string& input);

// The same on the lines `next_line` hands out (each without its '\n'; called
// until it returns false), streamed into spm_train's standard input: nothing
// is staged on disk but spm_train's own output, in the directory `scratch`
// (ALREADY_EXISTS if it exists; removed at the end). The model records its
// input as "/dev/stdin" and its prefix as "m", so the same lines and options
// give the same bytes. An error of `next_line` stops spm_train and is
// returned as it is.
absl::StatusOr<std::string> TrainSentencePieceOnLines(
    const SentencePieceTraining& options,
    const std::function<absl::StatusOr<bool>(std::string* line)>& next_line,
    const std::string& scratch);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_TOKENIZER_H_
