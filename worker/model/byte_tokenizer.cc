#include "worker/model/byte_tokenizer.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace detour::model {

std::vector<int32_t> ByteTokenizer::Encode(absl::string_view text) {
  std::vector<int32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    tokens[i] = static_cast<unsigned char>(text[i]);
  }
  return tokens;
}

absl::StatusOr<std::string> ByteTokenizer::Decode(absl::Span<const int32_t> tokens) {
  std::string text(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= kVocabSize) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", tokens[i], " at position ", i,
                       " is not a byte (byte tokenizer ids are 0..255)"));
    }
    text[i] = static_cast<char>(tokens[i]);
  }
  return text;
}

}  // namespace detour::model
