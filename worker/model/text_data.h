// Training text: reading, train/validation split, samples and deterministic
// sharding of samples over data nodes and iterations. No LibTorch here; the
// engine turns token spans into tensors.
//
// A *sample* is context_length+1 consecutive tokens (inputs and the targets
// shifted by one); sample i starts at token i·context_length, so consecutive
// samples share one boundary token and every token is predicted once.
// Functions are thread-safe; a TextDataset is immutable after construction and
// may be shared between threads.
#ifndef DETOUR_WORKER_MODEL_TEXT_DATA_H_
#define DETOUR_WORKER_MODEL_TEXT_DATA_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "detour/v1/spec.pb.h"

namespace detour::model {

// Most bytes of text one data path may hold (a file, or all files under a
// directory together): 256 MiB. Every byte becomes a 4-byte token, so a data
// node holds about 5× this in memory.
inline constexpr uint64_t kMaxTextSourceBytes = uint64_t{256} << 20;
// Most files under one data directory.
inline constexpr size_t kMaxTextSourceFiles = 100000;

// Reads a UTF-8 text file, or every regular file under a directory
// (recursively, in byte order of their paths, joined by "\n"). NOT_FOUND for a
// missing path; INVALID_ARGUMENT for a path that is neither a regular file
// nor a directory (a device, a FIFO, a socket: /dev/zero never ends) and for
// invalid UTF-8 (naming the file and byte offset); RESOURCE_EXHAUSTED naming
// the path when the text exceeds `max_bytes` or a directory holds more than
// kMaxTextSourceFiles files — checked from the sizes before anything is read,
// and again while reading (a file may grow), so no more than `max_bytes` + 1
// bytes are ever held; FAILED_PRECONDITION for an empty result.
absl::StatusOr<std::string> ReadTextSource(const std::string& path,
                                           uint64_t max_bytes = kMaxTextSourceBytes);

// OK iff `text` is valid UTF-8; otherwise INVALID_ARGUMENT with the offset.
absl::Status CheckUtf8(absl::string_view text);

// A read-only sequence of token ids, held in memory or viewed in a mapped
// token file (2 or 4 little-endian bytes per id). Cheap to copy (shared
// storage); immutable and thread-safe.
class TokenSequence {
 public:
  TokenSequence() = default;
  // Takes the tokens into shared storage (implicit: a vector is a sequence).
  TokenSequence(std::vector<int32_t> tokens);  // NOLINT(google-explicit-constructor)
  // `count` ids of `token_bytes` (2 or 4) each at `data`, kept valid by `owner`.
  static TokenSequence View(std::shared_ptr<const void> owner, const uint8_t* data, int64_t count,
                            int token_bytes);

  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // Requires 0 <= i < size().
  int32_t operator[](int64_t i) const {
    if (token_bytes_ == 2) {
      uint16_t v;
      std::memcpy(&v, data_ + i * 2, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, data_ + i * 4, 4);
    return static_cast<int32_t>(v);
  }
  // Copies ids [begin, begin + n) (requires them in range).
  std::vector<int32_t> Slice(int64_t begin, int64_t n) const;

 private:
  std::shared_ptr<const void> owner_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
  int token_bytes_ = 4;
};
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "token files are little-endian and read in place");

// Tokenised text split into a training and a validation part.
struct TextDataset {
  TokenSequence train;
  TokenSequence validation;
  // What produced the ids: "byte" or "fnv1a64:<hex>" of the SentencePiece
  // model (Tokenizer::checksum), and the vocabulary size.
  std::string tokenizer_checksum = "byte";
  int vocab_size = 256;
  // "fnv1a64:<hex>" of a prepared dataset's manifest; "" for text sources.
  std::string dataset_checksum;
};

// Holds out the last `validation_fraction` of the text (cut at the next line
// start so no line is split) for validation. INVALID_ARGUMENT for a fraction
// outside [0, 0.5].
absl::StatusOr<TextDataset> SplitText(absl::string_view text, double validation_fraction);

// The data a DataSpec names, split: the embedded corpus or a text
// file/directory (tokenised with data.tokenizer, the byte tokenizer by
// default), or a prepared dataset (token_shards.h; mapped, not loaded).
absl::StatusOr<TextDataset> LoadDataset(const v1::DataSpec& data);

// INVALID_ARGUMENT when the data's ids may not fit a model of
// `model_vocab_size` (the tokenizer's vocabulary is larger).
absl::Status CheckVocabulary(const TextDataset& data, int model_vocab_size);

// Number of whole samples of `context_length` in `tokens`.
int64_t NumSamples(int64_t num_tokens, int context_length);

// Sample `index` as a view of context_length+1 tokens. Requires
// index < NumSamples(tokens.size(), context_length).
absl::Span<const int32_t> SampleTokens(absl::Span<const int32_t> tokens, int64_t index,
                                       int context_length);
// The same from a TokenSequence, written to out[0..context_length].
void CopySample(const TokenSequence& tokens, int64_t index, int context_length, int64_t* out);

// Deterministic order of samples for data-parallel training. Global positions
// 0, 1, 2, ... run through epoch 0's permutation of all samples, then epoch
// 1's (a fresh permutation from the seed), and so on. Data node d of D owns the
// positions d, d+D, d+2D, ... (its *shard*); shard offset k is global position
// k·D + d. A data node starting microbatches for iteration i with n samples
// per iteration reads shard offsets [i·n, (i+1)·n) — the DataSlice of the
// IterationPlan. Within an epoch no two (node, offset) pairs share a sample.
// Immutable after construction; thread-safe.
class SampleSharder {
 public:
  SampleSharder(int64_t num_samples, int num_data_nodes, uint64_t seed);

  // Sample index for a node's shard offset.
  int64_t SampleAt(int data_node, uint64_t shard_offset) const;

  // Shard offsets of `data_node` in `iteration` for n samples per iteration.
  static uint64_t IterationOffset(uint64_t iteration, int samples_per_iteration) {
    return iteration * static_cast<uint64_t>(samples_per_iteration);
  }

  int64_t num_samples() const { return num_samples_; }
  int num_data_nodes() const { return num_data_nodes_; }

 private:
  // Keyed bijection of [0, num_samples): a 4-round Feistel network on the
  // next even power of two with cycle walking. O(1) memory, no shared state.
  int64_t Permute(uint64_t epoch, int64_t position) const;

  int64_t num_samples_;
  int num_data_nodes_;
  uint64_t seed_;
  int half_bits_;
};

// splitmix64: the project's portable PRNG step (the standard library's
// distributions are implementation-defined; this is not).
uint64_t SplitMix64(uint64_t* state);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_TEXT_DATA_H_
