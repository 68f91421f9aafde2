#include "common/json.h"

#include <string>

#include <gtest/gtest.h>

namespace detour {
namespace {

TEST(JsonTest, ParsesEveryKind) {
  auto v = ParseJson(
      R"( {"a": [1, -2.5e3, true, false, null], "s": "x\u00e9\ud83d\ude00\n", "o": {}} )");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_TRUE(v->is_object());
  const JsonValue* a = v->Find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->items().size(), 5u);
  uint64_t u = 0;
  EXPECT_TRUE(a->items()[0].AsUint64(&u));
  EXPECT_EQ(u, 1u);
  EXPECT_DOUBLE_EQ(a->items()[1].number(), -2500);
  EXPECT_FALSE(a->items()[1].AsUint64(&u));
  EXPECT_TRUE(a->items()[2].bool_value());
  EXPECT_TRUE(a->items()[4].is_null());
  EXPECT_EQ(v->Find("s")->string_value(), "x\xc3\xa9\xf0\x9f\x98\x80\n");
  EXPECT_TRUE(v->Find("o")->is_object());
  EXPECT_EQ(v->Find("missing"), nullptr);
}

TEST(JsonTest, IntegersAreExact) {
  auto v = ParseJson("[18446744073709551615, 9007199254740993, -9223372036854775808, 1.0, 1e2]");
  ASSERT_TRUE(v.ok());
  uint64_t u = 0;
  ASSERT_TRUE(v->items()[0].AsUint64(&u));
  EXPECT_EQ(u, UINT64_MAX);
  ASSERT_TRUE(v->items()[1].AsUint64(&u));
  EXPECT_EQ(u, 9007199254740993u);  // not rounded through a double
  int64_t i = 0;
  ASSERT_TRUE(v->items()[2].AsInt64(&i));
  EXPECT_EQ(i, INT64_MIN);
  EXPECT_FALSE(v->items()[3].AsInt64(&i));  // written with a fraction
  EXPECT_FALSE(v->items()[4].AsInt64(&i));
  auto big = ParseJson("[18446744073709551616]");
  ASSERT_TRUE(big.ok());
  EXPECT_FALSE(big->items()[0].AsUint64(&u));
}

TEST(JsonTest, RefusesMalformedInputWithThePosition) {
  const char* bad[] = {
      "",
      "{",
      "[1,]",
      "{\"a\":1,}",
      "{\"a\" 1}",
      "[01]",
      "[1.]",
      "[-]",
      "[1e]",
      "\"abc",
      "\"\\x\"",
      "\"\x01\"",
      "[tru]",
      "{} {}",
      "{\"a\":1,\"a\":2}",
      "\"\\ud800\"",
      "\"\\udc00\"",
      "\"\xc0\xaf\"",
      "\"\xed\xa0\x80\"",
      "\"\xff\"",
      "[1e999]",
      "{1:2}",
      "nul",
  };
  for (const char* text : bad) {
    auto v = ParseJson(text);
    EXPECT_FALSE(v.ok()) << "accepted: " << text;
    if (!v.ok()) {
      EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(v.status().message().find("JSON byte"), std::string::npos) << v.status();
    }
  }
  auto dup = ParseJson("{\"k\": 1, \"k\": 2}");
  EXPECT_NE(dup.status().message().find("duplicate key \"k\""), std::string::npos) << dup.status();
}

TEST(JsonTest, LimitsBoundDepthValuesAndSize) {
  JsonLimits limits;
  limits.max_depth = 3;
  EXPECT_TRUE(ParseJson("[[[1]]]", limits).ok());
  auto deep = ParseJson("[[[[1]]]]", limits);
  EXPECT_NE(deep.status().message().find("nesting deeper than 3"), std::string::npos);
  // Far deeper than the stack would allow without the limit.
  EXPECT_FALSE(ParseJson(std::string(1000000, '['), JsonLimits()).ok());
  limits = JsonLimits();
  limits.max_values = 4;
  EXPECT_TRUE(ParseJson("[1,2,3]", limits).ok());
  EXPECT_FALSE(ParseJson("[1,2,3,4]", limits).ok());
  limits = JsonLimits();
  limits.max_bytes = 4;
  EXPECT_FALSE(ParseJson("[1,2]", limits).ok());
}

TEST(JsonTest, QuoteRoundTrips) {
  const std::string s = "a\"b\\c\n\x01\xc3\xa9";
  auto v = ParseJson(JsonQuote(s));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->string_value(), s);
}

}  // namespace
}  // namespace detour
