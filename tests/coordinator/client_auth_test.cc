// Client roles from --auth_tokens and client certificates (the decision
// itself, without gRPC; e2e/tls_test.cc runs it on real daemons).
#include "coordinator/client_auth.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
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

// The tokens file is every client's secret: one that others may read or
// change is refused, as ssh refuses such keys (README's `echo ... >
// certs/tokens` made it 0644 and nothing said so).
TEST(LoadTokensFileTest, RefusesAFileOthersMayRead) {
  const std::string path = ::testing::TempDir() + "/client_auth_test_tokens";
  {
    std::ofstream out(path);
    out << "0123456789abcdef0123 submit alice\n";
  }
  ::chmod(path.c_str(), 0644);
  auto loaded = LoadTokensFile(path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(loaded.status().message()),
              ::testing::HasSubstr("--auth_tokens: " + path + " has mode 0644"));
  EXPECT_THAT(std::string(loaded.status().message()), ::testing::HasSubstr("chmod 600 " + path));
  ::chmod(path.c_str(), 0600);
  loaded = LoadTokensFile(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->size(), 1u);
  ::unlink(path.c_str());
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
      {"\nreader-token-0123456789 root\n", "line 2: role \"root\" is not read, submit or admin"},
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

// Callers are known by their token's name or certificate's CN, the owner
// of what they submit; an admin manages every job, others their own and
// jobs without an owner.
TEST(ClientAuthorizerTest, IdentifiesCallersAndWhatTheyMayManage) {
  const std::string file = std::string(kFile) +
                           "admin-token-0123456789 admin root\n"
                           "unnamed-token-0123456789 submit\n";
  ClientAuthorizer auth(ClientAuthorizer::Mode::kTokens, *ParseTokens(file, "tokens"));
  auto identify = [&](std::optional<absl::string_view> header, std::optional<std::string> cert) {
    return auth.Identify(header, cert, ClientRole::kSubmit, "Cancel");
  };
  auto bot = identify("Bearer submit-token-0123456789", std::nullopt);
  ASSERT_TRUE(bot.ok()) << bot.status();
  EXPECT_EQ(bot->name, "ci-bot");
  EXPECT_EQ(bot->role, ClientRole::kSubmit);
  auto root = identify("Bearer admin-token-0123456789", std::nullopt);
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ(root->name, "root");
  EXPECT_EQ(root->role, ClientRole::kAdmin);
  auto unnamed = identify("Bearer unnamed-token-0123456789", std::nullopt);
  ASSERT_TRUE(unnamed.ok()) << unnamed.status();
  EXPECT_EQ(unnamed->name, "");
  EXPECT_EQ(unnamed->Describe(), "an unnamed caller");
  auto by_cert = identify(std::nullopt, std::string("ci-bot"));
  ASSERT_TRUE(by_cert.ok()) << by_cert.status();
  EXPECT_EQ(by_cert->name, "ci-bot");
  EXPECT_EQ(identify(std::nullopt, std::string("alice")).status().code(),
            absl::StatusCode::kPermissionDenied);  // alice may only read

  EXPECT_TRUE(bot->MayManage("ci-bot"));
  EXPECT_FALSE(bot->MayManage("alice"));
  EXPECT_TRUE(bot->MayManage(""));  // no owner: any submitter
  EXPECT_TRUE(root->MayManage("alice"));
  EXPECT_FALSE(unnamed->MayManage("ci-bot"));

  // Without a tokens file: a certificate's CN names a `submit` caller; an
  // open coordinator makes everyone an admin.
  ClientAuthorizer certs(ClientAuthorizer::Mode::kCertificates, {});
  auto carol = certs.Identify(std::nullopt, std::string("carol"), ClientRole::kSubmit, "Submit");
  ASSERT_TRUE(carol.ok()) << carol.status();
  EXPECT_EQ(carol->name, "carol");
  EXPECT_EQ(carol->role, ClientRole::kSubmit);
  ClientAuthorizer open(ClientAuthorizer::Mode::kOpen, {});
  auto anyone = open.Identify(std::nullopt, std::nullopt, ClientRole::kSubmit, "Cancel");
  ASSERT_TRUE(anyone.ok()) << anyone.status();
  EXPECT_EQ(anyone->role, ClientRole::kAdmin);
  EXPECT_EQ(anyone->name, "");
  // A name that is not an identity name is not taken as one.
  auto odd = open.Identify(std::nullopt, std::string("a b"), ClientRole::kSubmit, "Cancel");
  ASSERT_TRUE(odd.ok());
  EXPECT_EQ(odd->name, "");
}

// A certificate gives a role only when it is a client's (or unmarked):
// a worker's or the coordinator's is refused naming what it is, whatever
// the mode; with a bearer token the token decides.
TEST(ClientAuthorizerTest, OnlyClientCertificatesAreClients) {
  ClientAuthorizer certs(ClientAuthorizer::Mode::kCertificates, {});
  EXPECT_TRUE(certs
                  .Authorize(std::nullopt, std::string("carol"), ClientRole::kSubmit, "Submit",
                             IdentityKind::kClient)
                  .ok());
  EXPECT_TRUE(certs
                  .Authorize(std::nullopt, std::string("carol"), ClientRole::kSubmit, "Submit",
                             IdentityKind::kUnmarked)
                  .ok());
  absl::Status worker = certs.Authorize(std::nullopt, std::string("w1"), ClientRole::kRead, "List",
                                        IdentityKind::kWorker);
  EXPECT_EQ(worker.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(worker.message()),
              HasSubstr("List: certificate CN=w1 is a worker's, not a client's"));
  absl::Status coordinator = certs.Authorize(std::nullopt, std::string("coordinator"),
                                             ClientRole::kRead, "Get", IdentityKind::kCoordinator);
  EXPECT_EQ(coordinator.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(coordinator.message()), HasSubstr("is a coordinator's"));

  ClientAuthorizer tokens(ClientAuthorizer::Mode::kTokens, *ParseTokens(kFile, "tokens"));
  // ci-bot is a listed name; a worker's certificate with that CN is still
  // not ci-bot the client.
  EXPECT_EQ(tokens
                .Authorize(std::nullopt, std::string("ci-bot"), ClientRole::kSubmit, "Submit",
                           IdentityKind::kWorker)
                .code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(tokens
                  .Authorize("Bearer submit-token-0123456789", std::string("w1"),
                             ClientRole::kSubmit, "Submit", IdentityKind::kWorker)
                  .ok());
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
