#include "common/hash.h"

#include <cstring>

#include "absl/strings/str_format.h"

namespace detour {
namespace {

// Odd 64-bit constants with well-spread bits (the fractional parts of the
// golden ratio and of sqrt(3)), so multiplying by them is a bijection.
constexpr uint64_t kMulA = 0x9e3779b97f4a7c15ULL;
constexpr uint64_t kMulB = 0xbb67ae8584caa73bULL;

uint64_t Load64(const unsigned char* p) {
  uint64_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// One word into a lane: xor, multiply by an odd constant, xor-shift. Each
// step is a bijection of the lane for a given word, so lanes that differ stay
// different, and a changed word changes its lane.
inline uint64_t Step(uint64_t lane, uint64_t word) {
  lane = (lane ^ word) * kMulA;
  return lane ^ (lane >> 29);
}

// Final avalanche of one 64-bit value (also a bijection).
inline uint64_t Mix(uint64_t x) {
  x ^= x >> 32;
  x *= kMulB;
  x ^= x >> 29;
  x *= kMulA;
  return x ^ (x >> 32);
}

}  // namespace

std::string Fnv1a64::Hex() const { return absl::StrFormat("fnv1a64:%016x", h_); }

uint64_t Fnv1a64Of(absl::string_view bytes) {
  Fnv1a64 f;
  f.Add(bytes);
  return f.value();
}

FastHash64::FastHash64(uint64_t seed) {
  for (int i = 0; i < 4; ++i) lanes_[i] = Mix(seed + static_cast<uint64_t>(i + 1) * kMulB);
}

void FastHash64::Add(const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  size_t n = size;
  // Four words a round, one per lane: the lanes' multiplies are independent,
  // so the processor overlaps them.
  while (n >= 32) {
    lanes_[0] = Step(lanes_[0], Load64(p));
    lanes_[1] = Step(lanes_[1], Load64(p + 8));
    lanes_[2] = Step(lanes_[2], Load64(p + 16));
    lanes_[3] = Step(lanes_[3], Load64(p + 24));
    p += 32;
    n -= 32;
  }
  while (n >= 8) {
    lanes_[0] = Step(lanes_[0], Load64(p));
    p += 8;
    n -= 8;
  }
  if (n > 0) {
    uint64_t tail = 0;
    std::memcpy(&tail, p, n);
    // The tail's length goes into the word so "a" and "a\0" differ.
    lanes_[1] = Step(lanes_[1], tail ^ (static_cast<uint64_t>(n) << 56));
  }
  // The piece's length separates ("ab", "c") from ("a", "bc").
  lanes_[3] = Step(lanes_[3], static_cast<uint64_t>(size));
  total_ += size;
}

uint64_t FastHash64::value() const {
  uint64_t h = Mix(total_);
  for (uint64_t lane : lanes_) h = Step(h, Mix(lane));
  return Mix(h);
}

}  // namespace detour
