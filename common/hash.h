// The project's two hashes, each defined once. Thread-safe (no shared state).
//
// Fnv1a64: FNV-1a 64 over bytes, the checksum of files and names that is
// written to disk ("fnv1a64:<16 hex digits>" in checkpoint manifests,
// tokenizer and dataset checksums) and so must never change.
//
// FastHash64: a word-at-a-time hash for large in-memory buffers (a stage's
// parameters hashed after every step to compare replicas). Four independent
// lanes, each stepped by a bijection of its state, so a buffer that differs
// from another in one 8-byte word always hashes differently; about 20 times
// the speed of byte-wise FNV (benchmarks/hash_benchmark.cc). Not stored,
// not cryptographic, and equal only on machines of the same byte order.
#ifndef DETOUR_COMMON_HASH_H_
#define DETOUR_COMMON_HASH_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace detour {

// FNV-1a 64 fed in pieces: Fnv1a64 f; f.Add(a); f.Add(b) equals one Add(a + b).
class Fnv1a64 {
 public:
  void Add(absl::string_view bytes) {
    for (unsigned char c : bytes) {
      h_ ^= c;
      h_ *= 0x100000001b3ULL;
    }
  }
  uint64_t value() const { return h_; }
  // "fnv1a64:<16 hex digits>".
  std::string Hex() const;

 private:
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

// FNV-1a 64 of `bytes`.
uint64_t Fnv1a64Of(absl::string_view bytes);

// FastHash64 fed in pieces. The value depends on where the pieces split (each
// piece's length is mixed in), so callers feed the same pieces in the same
// order: e.g. one tensor after another.
class FastHash64 {
 public:
  explicit FastHash64(uint64_t seed = 0);
  void Add(const void* data, size_t size);
  uint64_t value() const;

 private:
  uint64_t lanes_[4];
  uint64_t total_ = 0;
};

}  // namespace detour

#endif  // DETOUR_COMMON_HASH_H_
