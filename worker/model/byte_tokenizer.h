// Byte-level tokenizer: token t in [0, 256) is the byte t. Needs no
// vocabulary file, round-trips arbitrary bytes (UTF-8 or not), and works with
// any vocab_size >= 256 (larger vocabularies simply leave ids unused).
// Stateless and thread-safe.
#ifndef DETOUR_WORKER_MODEL_BYTE_TOKENIZER_H_
#define DETOUR_WORKER_MODEL_BYTE_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace detour::model {

class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;

  static std::vector<int32_t> Encode(absl::string_view text);
  // INVALID_ARGUMENT naming the position of the first id outside [0, 256).
  static absl::StatusOr<std::string> Decode(absl::Span<const int32_t> tokens);
};

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_BYTE_TOKENIZER_H_
