// Identity kinds (common/net/identity.h) on certificates that
// tools/gen_certs.sh makes, and on ones made by hand with openssl the way
// older detour versions or another CA would: unmarked, marked for another
// name, marked twice, an unknown kind.
#include "common/net/identity.h"

#include <stdlib.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_paths.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class IdentityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::ProcessTempDir() + "/identity-test");
    const std::string script = testing::SourceDir() + "/tools/gen_certs.sh";
    Sh(absl::StrCat(script, " ", *dir_,
                    " --worker w1 --coordinator coordinator --client alice > /dev/null"));
  }

  static void Sh(const std::string& command) {
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
  }

  // A certificate from the same CA with `sans` (an openssl subjectAltName
  // value) and CN=name, as a CA other than gen_certs.sh would make it.
  static std::string ByHand(const std::string& name, const std::string& sans) {
    const std::string d = *dir_;
    Sh(absl::StrCat("cd ", d, " && openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 ",
                    "-out ", name, ".key 2>/dev/null && openssl req -new -key ", name,
                    ".key -subj /CN=", name, " -out ", name, ".csr && printf '%s\\n' ",
                    "'subjectAltName=", sans, "' > ", name, ".ext && openssl x509 -req -in ", name,
                    ".csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -extfile ", name,
                    ".ext -out ", name, ".crt 2>/dev/null"));
    return ReadAll(d + "/" + name + ".crt");
  }

  static std::string Pem(const std::string& name) { return ReadAll(*dir_ + "/" + name + ".crt"); }

  static std::string* dir_;
};
std::string* IdentityTest::dir_ = nullptr;

TEST_F(IdentityTest, GenCertsMarksEachKind) {
  auto worker = ReadCertificateIdentity(Pem("w1"));
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->name, "w1");
  EXPECT_EQ(worker->kind, IdentityKind::kWorker);
  EXPECT_EQ(worker->uri, "detour://worker/w1");
  EXPECT_TRUE(CheckWorkerCertificatePem(Pem("w1"), /*allow_unmarked=*/false).ok());

  auto coordinator = ReadCertificateIdentity(Pem("coordinator"));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  EXPECT_EQ(coordinator->kind, IdentityKind::kCoordinator);
  absl::Status s = CheckWorkerCertificatePem(Pem("coordinator"), /*allow_unmarked=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("is a coordinator's"));
  EXPECT_THAT(s.message(), HasSubstr("not a worker's"));

  auto client = ReadCertificateIdentity(Pem("alice"));
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ(client->kind, IdentityKind::kClient);
  s = CheckWorkerCertificatePem(Pem("alice"), /*allow_unmarked=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("certificate CN=alice is a client's"));
}

TEST_F(IdentityTest, AnUnmarkedCertificateIsAWorkersOnlyWhenAllowed) {
  const std::string pem = ByHand("legacy", "DNS:legacy,IP:127.0.0.1");
  auto identity = ReadCertificateIdentity(pem);
  ASSERT_TRUE(identity.ok()) << identity.status();
  EXPECT_EQ(identity->kind, IdentityKind::kUnmarked);
  absl::Status s = CheckWorkerCertificatePem(pem, /*allow_unmarked=*/false);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("is not marked as a worker's"));
  EXPECT_THAT(s.message(), HasSubstr("regenerate it with tools/gen_certs.sh DIR --worker legacy"));
  EXPECT_THAT(s.message(), HasSubstr("--allow_unmarked_worker_certs"));
  EXPECT_TRUE(CheckWorkerCertificatePem(pem, /*allow_unmarked=*/true).ok());
  // Other URIs are not markings.
  const std::string spiffe = ByHand("spiffe", "URI:spiffe://example.org/w");
  EXPECT_EQ(ReadCertificateIdentity(spiffe)->kind, IdentityKind::kUnmarked);
}

TEST_F(IdentityTest, MarkingsThatCannotBeTrustedAreRefusedEvenWhenUnmarkedOnesAreAllowed) {
  struct Case {
    std::string name, sans, why;
  };
  for (const Case& c : {
           Case{"other", "URI:detour://worker/w1", "which names another identity than its CN"},
           Case{"twice", "URI:detour://worker/twice,URI:detour://client/twice", "one kind"},
           Case{"admin", "URI:detour://admin/admin", "an unknown identity kind"},
           Case{"bare", "URI:detour://worker", "which names another identity"},
       }) {
    SCOPED_TRACE(c.name);
    const std::string pem = ByHand(c.name, c.sans);
    auto identity = ReadCertificateIdentity(pem);
    EXPECT_EQ(identity.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_THAT(identity.status().message(), HasSubstr(c.why));
    EXPECT_EQ(CheckWorkerCertificatePem(pem, /*allow_unmarked=*/true).code(),
              absl::StatusCode::kPermissionDenied);
  }
  EXPECT_EQ(ReadCertificateIdentity("not a certificate").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace detour
