#include "common/json.h"

#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace detour {

bool JsonValue::AsUint64(uint64_t* out) const {
  if (kind_ != Kind::kNumber) return false;
  if (text_.find_first_not_of("0123456789") != std::string::npos) return false;
  return absl::SimpleAtoi(text_, out);
}

bool JsonValue::AsInt64(int64_t* out) const {
  if (kind_ != Kind::kNumber) return false;
  const size_t digits = !text_.empty() && text_[0] == '-' ? 1 : 0;
  if (text_.find_first_not_of("0123456789", digits) != std::string::npos) return false;
  return absl::SimpleAtoi(text_, out);
}

const JsonValue* JsonValue::Find(absl::string_view key) const {
  if (kind_ != Kind::kObject) return nullptr;
  for (size_t i = 0; i < keys_.size(); ++i) {
    if (keys_[i] == key) return &items_[i];
  }
  return nullptr;
}

const char* JsonValue::KindName(Kind kind) {
  switch (kind) {
    case Kind::kNull: return "null";
    case Kind::kBool: return "a bool";
    case Kind::kNumber: return "a number";
    case Kind::kString: return "a string";
    case Kind::kArray: return "an array";
    case Kind::kObject: return "an object";
  }
  return "?";
}

// Recursive descent over the text; depth and value count bounded.
class JsonParser {
 public:
  JsonParser(absl::string_view text, const JsonLimits& limits) : s_(text), limits_(limits) {}

  absl::StatusOr<JsonValue> Document() {
    if (s_.size() > limits_.max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "JSON document is ", s_.size(), " bytes, more than the limit of ", limits_.max_bytes));
    }
    JsonValue v;
    if (!Value(&v, 0)) return Error();
    SkipSpace();
    if (pos_ != s_.size()) {
      Fail("unexpected content after the document");
      return Error();
    }
    return v;
  }

 private:
  absl::Status Error() const {
    return absl::InvalidArgumentError(absl::StrCat("JSON byte ", error_pos_, ": ", error_));
  }
  bool Fail(std::string why) {
    if (error_.empty()) {
      error_ = std::move(why);
      error_pos_ = pos_;
    }
    return false;
  }
  void SkipSpace() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Literal(absl::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return Fail("invalid literal");
    pos_ += word.size();
    return true;
  }

  bool Value(JsonValue* v, int depth) {
    if (++values_ > limits_.max_values) {
      return Fail(absl::StrCat("more than ", limits_.max_values, " values"));
    }
    SkipSpace();
    if (pos_ >= s_.size()) return Fail("unexpected end of input");
    const char c = s_[pos_];
    switch (c) {
      case '{':
      case '[':
        if (depth >= limits_.max_depth) {
          return Fail(absl::StrCat("nesting deeper than ", limits_.max_depth));
        }
        return c == '{' ? Object(v, depth + 1) : Array(v, depth + 1);
      case '"': v->kind_ = JsonValue::Kind::kString; return String(&v->text_);
      case 't':
        v->kind_ = JsonValue::Kind::kBool;
        v->bool_ = true;
        return Literal("true");
      case 'f': v->kind_ = JsonValue::Kind::kBool; return Literal("false");
      case 'n': return Literal("null");
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return Number(v);
        return Fail(absl::StrFormat("unexpected character 0x%02x", static_cast<unsigned char>(c)));
    }
  }

  bool Object(JsonValue* v, int depth) {
    v->kind_ = JsonValue::Kind::kObject;
    absl::flat_hash_set<std::string> seen;
    ++pos_;  // '{'
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return true;
    }
    while (true) {
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Fail("expected a string key");
      const size_t key_pos = pos_;
      std::string key;
      if (!String(&key)) return false;
      if (!seen.insert(key).second) {
        pos_ = key_pos;
        return Fail(absl::StrCat("duplicate key \"", key.substr(0, 200), "\""));
      }
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != ':') return Fail("expected ':'");
      ++pos_;
      JsonValue item;
      if (!Value(&item, depth)) return false;
      v->keys_.push_back(std::move(key));
      v->items_.push_back(std::move(item));
      SkipSpace();
      if (pos_ >= s_.size()) return Fail("unterminated object");
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] == '}') {
        ++pos_;
        return true;
      }
      return Fail("expected ',' or '}'");
    }
  }

  bool Array(JsonValue* v, int depth) {
    v->kind_ = JsonValue::Kind::kArray;
    ++pos_;  // '['
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return true;
    }
    while (true) {
      JsonValue item;
      if (!Value(&item, depth)) return false;
      v->items_.push_back(std::move(item));
      SkipSpace();
      if (pos_ >= s_.size()) return Fail("unterminated array");
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] == ']') {
        ++pos_;
        return true;
      }
      return Fail("expected ',' or ']'");
    }
  }

  bool Digits() {
    const size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    return pos_ > start;
  }

  bool Number(JsonValue* v) {
    const size_t start = pos_;
    if (s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
      if (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
        return Fail("number with a leading zero");
      }
    } else if (!Digits()) {
      return Fail("malformed number");
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!Digits()) return Fail("malformed number: no digits after '.'");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!Digits()) return Fail("malformed number: no digits in the exponent");
    }
    v->kind_ = JsonValue::Kind::kNumber;
    v->text_ = std::string(s_.substr(start, pos_ - start));
    if (v->text_.size() > 512) {
      pos_ = start;
      return Fail("number longer than 512 characters");
    }
    if (!absl::SimpleAtod(v->text_, &v->number_) || !std::isfinite(v->number_)) {
      pos_ = start;
      return Fail(absl::StrCat("number ", v->text_.substr(0, 40), " is out of range"));
    }
    return true;
  }

  bool Hex4(uint32_t* out) {
    if (s_.size() - pos_ < 4) return Fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        v |= c - 'A' + 10;
      else
        return Fail("bad hex digit in \\u escape");
    }
    *out = v;
    return true;
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  bool Escape(std::string* out) {
    if (pos_ >= s_.size()) return Fail("unterminated string");
    const char c = s_[pos_++];
    switch (c) {
      case '"': out->push_back('"'); return true;
      case '\\': out->push_back('\\'); return true;
      case '/': out->push_back('/'); return true;
      case 'b': out->push_back('\b'); return true;
      case 'f': out->push_back('\f'); return true;
      case 'n': out->push_back('\n'); return true;
      case 'r': out->push_back('\r'); return true;
      case 't': out->push_back('\t'); return true;
      case 'u': break;
      default: --pos_; return Fail("invalid escape");
    }
    uint32_t cp = 0;
    if (!Hex4(&cp)) return false;
    if (cp >= 0xDC00 && cp <= 0xDFFF) return Fail("unpaired low surrogate");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      uint32_t low = 0;
      if (s_.substr(pos_, 2) != "\\u") return Fail("unpaired high surrogate");
      pos_ += 2;
      if (!Hex4(&low)) return false;
      if (low < 0xDC00 || low > 0xDFFF) return Fail("unpaired high surrogate");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    }
    AppendUtf8(cp, out);
    return true;
  }

  // One UTF-8 sequence starting at pos_ (a lead byte >= 0x80), validated:
  // no overlong forms, no surrogates, nothing above U+10FFFF.
  bool Utf8(std::string* out) {
    const auto b0 = static_cast<unsigned char>(s_[pos_]);
    int n = 0;
    uint32_t cp = 0, min = 0;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      n = 1;
      cp = b0 & 0x1F;
      min = 0x80;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      n = 2;
      cp = b0 & 0x0F;
      min = 0x800;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      n = 3;
      cp = b0 & 0x07;
      min = 0x10000;
    } else
      return Fail("invalid UTF-8");
    if (s_.size() - pos_ <= static_cast<size_t>(n)) return Fail("truncated UTF-8");
    for (int i = 1; i <= n; ++i) {
      const auto b = static_cast<unsigned char>(s_[pos_ + i]);
      if ((b & 0xC0) != 0x80) return Fail("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return Fail("invalid UTF-8");
    }
    out->append(s_.data() + pos_, n + 1);
    pos_ += n + 1;
    return true;
  }

  bool String(std::string* out) {
    ++pos_;  // '"'
    while (true) {
      if (pos_ >= s_.size()) return Fail("unterminated string");
      const auto c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return true;
      }
      if (c == '\\') {
        ++pos_;
        if (!Escape(out)) return false;
      } else if (c < 0x20) {
        return Fail("control character in a string");
      } else if (c >= 0x80) {
        if (!Utf8(out)) return false;
      } else {
        out->push_back(static_cast<char>(c));
        ++pos_;
      }
    }
  }

  absl::string_view s_;
  const JsonLimits& limits_;
  size_t pos_ = 0;
  size_t values_ = 0;
  std::string error_;
  size_t error_pos_ = 0;
};

absl::StatusOr<JsonValue> ParseJson(absl::string_view text, const JsonLimits& limits) {
  JsonParser parser(text, limits);
  return parser.Document();
}

std::string JsonQuote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace detour
