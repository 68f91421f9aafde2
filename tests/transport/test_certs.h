// Certificates for the transport tests, from tools/gen_certs.sh: workers
// "w1" and "w2" and client "alice" from the cluster CA, worker "intruder"
// from another CA. Made once per test binary.
#ifndef DETOUR_TESTS_TRANSPORT_TEST_CERTS_H_
#define DETOUR_TESTS_TRANSPORT_TEST_CERTS_H_

#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/net/tls.h"
#include "gtest/gtest.h"
#include "tests/test_paths.h"

namespace detour {

struct Certs {
  std::string dir, other_dir;
  TransportSecurity Load(const std::string& name, bool other_ca = false) const {
    const std::string d = other_ca ? other_dir : dir;
    auto s = TransportSecurity::Load(
        TlsFiles{d + "/" + name + ".crt", d + "/" + name + ".key", d + "/ca.crt", false},
        /*client=*/false);
    EXPECT_TRUE(s.ok()) << s.status();
    return *s;
  }
};

inline const Certs& TestCerts() {
  static const Certs* const certs = [] {
    auto* c = new Certs;
    const std::string root = testing::ProcessTempDir() + "/direct-test-certs";
    c->dir = root + "/ca";
    c->other_dir = root + "/other";
    const std::string script = testing::SourceDir() + "/tools/gen_certs.sh";
    const std::string make =
        absl::StrCat(script, " ", c->dir, " --worker w1 w2 --client alice > /dev/null && ", script,
                     " ", c->other_dir, " --worker intruder w1 > /dev/null");
    if (std::system(make.c_str()) != 0) {
      std::fprintf(stderr, "cannot make certificates: %s\n", make.c_str());
      std::abort();
    }
    return c;
  }();
  return *certs;
}

}  // namespace detour

#endif  // DETOUR_TESTS_TRANSPORT_TEST_CERTS_H_
