// Fuzzes the safetensors parser (worker/model/safetensors.h; no LibTorch, so
// it runs under ASan/UBSan) and the strict JSON parser under it: arbitrary
// bytes. Nothing may crash; an accepted file must have tensors that tile its
// buffer with dtype × shape bytes each, and encoding them again must give a
// file that parses to the same tensors and metadata.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "worker/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using detour::model::SafetensorsDTypeBytes;
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  auto parsed = detour::model::ParseSafetensors(bytes, "fuzz.safetensors");
  if (!parsed.ok()) return 0;
  const char* at = bytes.data() + 8 + parsed->header_bytes;
  for (const auto& t : parsed->tensors) {
    if (t.numel() * SafetensorsDTypeBytes(t.dtype) != t.data.size()) std::abort();
    if (t.data.data() != at) std::abort();  // contiguous, in offset order
    at += t.data.size();
    if (parsed->Find(t.name) != &t) std::abort();
  }
  if (at != bytes.data() + bytes.size()) std::abort();
  auto again = detour::model::EncodeSafetensors(parsed->tensors, parsed->metadata);
  if (!again.ok()) std::abort();
  auto reparsed = detour::model::ParseSafetensors(*again, "fuzz.safetensors");
  if (!reparsed.ok() || reparsed->metadata != parsed->metadata ||
      reparsed->tensors.size() != parsed->tensors.size()) {
    std::abort();
  }
  for (size_t i = 0; i < parsed->tensors.size(); ++i) {
    const auto& a = parsed->tensors[i];
    const auto& b = reparsed->tensors[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.data != b.data) {
      std::abort();
    }
  }
  return 0;
}
