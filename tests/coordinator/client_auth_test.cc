// Client roles from --auth_tokens and client certificates (the decision
// itself, without gRPC; e2e/tls_test.cc runs it on real daemons).
#include "coordinator/client_auth.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

constexpr char kFile[] =
    "# who may do what\n"
    "\n"
    "reader-token-0123456789 read alice\n"
    "  submit-token-0123456789\tsubmit   ci-bot  \n";

TEST(ParseTokensTest, ReadsEntries) {
  auto tokens = ParseTokens(kFile, "tokens");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 2u);
  EXPECT_EQ((*tokens)[0].token, "reader-token-0123456789");
  EXPECT_EQ((*tokens)[0].role, ClientRole::kRead);
  EXPECT_EQ((*tokens)[0].name, "alice");
  EXPECT_EQ((*tokens)[1].role, ClientRole::kSubmit);
  EXPECT_EQ((*tokens)[1].name, "ci-bot");
}

TEST(ParseTokensTest, MistakesNameTheLine) {
  struct Case {
    std::string text;
    std::string error;
  };
  const Case cases[] = {
      {"", "lists no token"},
      {"# only a comment\n", "lists no token"},
      {"x\n", "line 1: expected TOKEN ROLE [NAME], found 1 field(s)"},
      {"a b c d\n", "found 4 field(s)"},
      {"short read\n", "line 1: the token is 5 characters; tokens are 16..512"},
      {"\nreader-token-0123456789 admin\n", "line 2: role \"admin\" is not read or submit"},
      {"reader-token-0123456789 read bad/name\n", "the name is not 1..128 characters"},
      {"reader-token-0123456789 read a\nreader-token-0123456789 submit b\n",
       "line 2: this token is listed on an earlier line too"},
      {"reader-token-0123456789 read a\nsubmit-token-0123456789 submit a\n",
       "line 2: name a is listed twice"},
      {"reader-token-01234\x01"
       "6789 read\n",
       "non-printable"},
      {std::string(2 << 20, '#'), "more than 1048576"},
  };
  for (const Case& c : cases) {
    auto tokens = ParseTokens(c.text, "tokens");
    ASSERT_FALSE(tokens.ok()) << c.text.substr(0, 80);
    EXPECT_EQ(tokens.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(tokens.status().message()), HasSubstr(c.error)) << c.text.substr(0, 80);
  }
}

TEST(ClientAuthorizerTest, TokensAndCertificatesGetTheirRoles) {
  ClientAuthorizer auth(ClientAuthorizer::Mode::kTokens, *ParseTokens(kFile, "tokens"));
  const std::optional<std::string> none;
  auto check = [&](std::optional<absl::string_view> header, std::optional<std::string> cert,
                   ClientRole needed) {
    return auth.Authorize(header, cert, needed, "Submit").code();
  };
  using absl::StatusCode;
  EXPECT_EQ(check(std::nullopt, none, ClientRole::kRead), StatusCode::kUnauthenticated);
  EXPECT_EQ(check("Bearer nope-nope-nope-nope", none, ClientRole::kRead),
            StatusCode::kUnauthenticated);
  EXPECT_EQ(check("Basic reader-token-0123456789", none, ClientRole::kRead),
            StatusCode::kUnauthenticated);
  EXPECT_EQ(check("Bearer reader-token-0123456789", none, ClientRole::kRead), StatusCode::kOk);
  EXPECT_EQ(check("bearer reader-token-0123456789", none, ClientRole::kRead), StatusCode::kOk);
  EXPECT_EQ(check("Bearer reader-token-0123456789", none, ClientRole::kSubmit),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(check("Bearer submit-token-0123456789", none, ClientRole::kSubmit), StatusCode::kOk);
  // A prefix of a token is not the token.
  EXPECT_EQ(check("Bearer submit-token-012345678", none, ClientRole::kRead),
            StatusCode::kUnauthenticated);
  // Certificates: by the NAME column; unnamed ones have no role.
  EXPECT_EQ(check(std::nullopt, std::string("alice"), ClientRole::kRead), StatusCode::kOk);
  EXPECT_EQ(check(std::nullopt, std::string("alice"), ClientRole::kSubmit),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(check(std::nullopt, std::string("ci-bot"), ClientRole::kSubmit), StatusCode::kOk);
  EXPECT_EQ(check(std::nullopt, std::string("w1"), ClientRole::kRead),
            StatusCode::kPermissionDenied);
  // A token, when given, decides (a wrong one is not rescued by a certificate).
  EXPECT_EQ(check("Bearer wrong-wrong-wrong-wrong", std::string("ci-bot"), ClientRole::kRead),
            StatusCode::kUnauthenticated);
  // The message says who and what was missing.
  absl::Status s =
      auth.Authorize("Bearer reader-token-0123456789", none, ClientRole::kSubmit, "Cancel");
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("token alice has role read; Cancel needs submit"));
}

TEST(ClientAuthorizerTest, ModesWithoutATokensFile) {
  ClientAuthorizer open(ClientAuthorizer::Mode::kOpen, {});
  EXPECT_TRUE(open.Authorize(std::nullopt, std::nullopt, ClientRole::kSubmit, "Submit").ok());
  ClientAuthorizer certs(ClientAuthorizer::Mode::kCertificates, {});
  EXPECT_TRUE(
      certs.Authorize(std::nullopt, std::string("anyone"), ClientRole::kSubmit, "Submit").ok());
  EXPECT_EQ(certs.Authorize(std::nullopt, std::nullopt, ClientRole::kRead, "List").code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(ConstantTimeEqualsTest, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", ""));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
}

}  // namespace
}  // namespace detour
