// End-to-end: TLS and identity on real daemons. Plaintext only on request;
// client RPCs need a token or certificate with a role; a worker registers
// only under its certificate's name and with a certificate from the cluster
// CA; a worker's ActivationService takes frames only from certified members
// of its job.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/net/tls.h"
#include "detour/v1/control_service.grpc.pb.h"
#include "detour/v1/job_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/local_cluster.h"
#include "tests/e2e/micro_job.h"
#include "worker/transport/peer_sender.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kReadToken[] = "read-token-0123456789abcdef";
constexpr char kSubmitToken[] = "submit-token-0123456789abcdef";

class TlsTest : public E2eTest {
 protected:
  // A coordinator and two workers running a long two-stage job (both hold a
  // stage of it and talk over mutual TLS), past its second iteration.
  struct TwoWorkerJob {
    Daemon c;
    std::vector<Daemon> workers;
    v1::Job job;
  };
  void StartTwoWorkerJob(TwoWorkerJob* run) {
    run->c = StartCoordinator();
    run->workers = StartWorkers(run->c.grpc_port, 2, WorkerFlags());
    ASSERT_EQ(run->workers.size(), 2u);
    run->job = Submit(run->c.grpc_port, MicroJob(2, 1, 1, 0.0, 100000));
    const int port = run->c.grpc_port;
    const std::string id = run->job.id();
    ASSERT_TRUE(
        Eventually([&] { return GetJob(port, id).progress().iteration() >= 2; }, absl::Seconds(60)))
        << GetJob(port, id).message();
  }

  // Client credentials: the test CA, optionally a certificate of `name`.
  static TransportSecurity Client(const std::string& name = "") {
    TlsFiles files;
    files.ca = CertsDir() + "/ca.crt";
    if (!name.empty()) {
      files.cert = CertFor(name) + ".crt";
      files.key = CertFor(name) + ".key";
    }
    auto loaded = TransportSecurity::Load(files, /*client=*/true);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    return loaded.ok() ? *loaded : TransportSecurity::Insecure();
  }

  // Written 0600: detourctl refuses a token file that others may read.
  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    ::chmod(path.c_str(), 0600);
    return path;
  }

  // A coordinator with --auth_tokens: kReadToken (read, also the role of
  // certificate "reader") and kSubmitToken (submit).
  Daemon StartCoordinatorWithTokens() {
    const std::string tokens =
        WriteFile("tokens", absl::StrCat("# test tokens\n", kReadToken, " read reader\n",
                                         kSubmitToken, " submit\n",
                                         // names a worker: its certificate still gets no role
                                         "worker-named-token-0123456789 read w1\n"));
    return StartCoordinator({"--auth_tokens=" + tokens});
  }

  // A second, unrelated CA with a certificate for `name`; returns its dir.
  std::string OtherCa(const std::string& name) {
    const std::string other = dir_ + "/other-ca";
    std::string out;
    EXPECT_EQ(Run({SourceDir() + "/tools/gen_certs.sh", other, CertKind(name), name}, &out), 0)
        << out;
    return other;
  }
};

grpc::StatusCode SubmitCode(v1::JobService::Stub* stub, const std::string& token,
                            std::string* job_id = nullptr) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  v1::SubmitJobRequest request;
  *request.mutable_spec() = MicroJob(2, 1, 1, 0.0, 1);
  v1::Job job;
  grpc::Status status = stub->Submit(&context, request, &job);
  if (job_id != nullptr) *job_id = job.id();
  return status.error_code();
}

grpc::StatusCode ListCode(v1::JobService::Stub* stub, const std::string& token) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  v1::ListJobsResponse response;
  return stub->List(&context, v1::ListJobsRequest(), &response).error_code();
}

grpc::StatusCode CancelCode(v1::JobService::Stub* stub, const std::string& token,
                            const std::string& id) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  v1::CancelJobRequest request;
  request.set_job_id(id);
  v1::Job job;
  return stub->Cancel(&context, request, &job).error_code();
}

grpc::StatusCode WatchCode(v1::JobService::Stub* stub, const std::string& id) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::WatchJobRequest request;
  request.set_job_id(id);
  auto reader = stub->Watch(&context, request);
  v1::JobEvent event;
  while (reader->Read(&event)) {}
  return reader->Finish().error_code();
}

TEST_F(TlsTest, DaemonsRefuseToStartWithoutTlsOrInsecure) {
  std::string out;
  EXPECT_EQ(Run({Bin(kCoordinator), "--listen=127.0.0.1:0", "--metrics_port=-1",
                 absl::StrCat("--data_dir=", dir_, "/c")},
                &out, absl::Seconds(30), /*add_security=*/false),
            2);
  EXPECT_THAT(out, HasSubstr("no TLS: give --tls_cert, --tls_key and --tls_ca"));
  EXPECT_THAT(out, HasSubstr("--insecure"));
  EXPECT_EQ(Run({Bin(kWorker), "--listen=127.0.0.1:0", "--metrics_port=-1",
                 absl::StrCat("--data_dir=", dir_, "/w")},
                &out, absl::Seconds(30), false),
            2);
  EXPECT_THAT(out, HasSubstr("no TLS"));
  EXPECT_EQ(Run({Bin(kCtl), "list"}, &out, absl::Seconds(30), false), 2);
  EXPECT_THAT(out, HasSubstr("--tls_ca"));

  // Files are checked at start: a key of another certificate, a certificate
  // of another CA, a missing file.
  const std::string ours = CertFor("coordinator");
  const std::string ca = absl::StrCat("--tls_ca=", CertsDir(), "/ca.crt");
  EXPECT_EQ(Run({Bin(kCoordinator), "--tls_cert=" + ours + ".crt",
                 "--tls_key=" + CertFor("e2e-client") + ".key", ca},
                &out, absl::Seconds(30), false),
            2);
  EXPECT_THAT(out, HasSubstr("is not the key of the certificate in " + ours + ".crt"));
  const std::string other = OtherCa("coordinator");
  EXPECT_EQ(Run({Bin(kCoordinator), "--tls_cert=" + other + "/coordinator.crt",
                 "--tls_key=" + other + "/coordinator.key", ca},
                &out, absl::Seconds(30), false),
            2);
  EXPECT_THAT(out, HasSubstr("does not verify against --tls_ca"));
  EXPECT_EQ(Run({Bin(kWorker), "--tls_cert=" + ours + ".crt", "--tls_key=" + ours + ".key",
                 "--tls_ca=" + dir_ + "/missing.crt"},
                &out, absl::Seconds(30), false),
            2);
  EXPECT_THAT(out, HasSubstr("--tls_ca: " + dir_ + "/missing.crt does not exist"));
  // A tokens file with a mistake names its line.
  const std::string tokens = WriteFile("bad_tokens", "# ok\nshort read\n");
  EXPECT_EQ(Run({Bin(kCoordinator), "--auth_tokens=" + tokens}, &out), 2);
  EXPECT_THAT(out, HasSubstr(tokens + " line 2: the token is 5 characters"));
}

TEST_F(TlsTest, ClientsNeedATokenOrCertificateWithTheRole) {
  Daemon c = StartCoordinatorWithTokens();
  ASSERT_GT(c.grpc_port, 0);
  const std::string address = absl::StrCat("127.0.0.1:", c.grpc_port);
  auto anonymous = v1::JobService::NewStub(MakeChannel(address, Client()));

  // No credentials: UNAUTHENTICATED for everything; a wrong token too.
  EXPECT_EQ(SubmitCode(anonymous.get(), ""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ListCode(anonymous.get(), ""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(WatchCode(anonymous.get(), "job-000001"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(CancelCode(anonymous.get(), "", "job-000001"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(SubmitCode(anonymous.get(), "not-a-token-0123456789"),
            grpc::StatusCode::UNAUTHENTICATED);

  // submit may submit and cancel.
  std::string id;
  ASSERT_EQ(SubmitCode(anonymous.get(), kSubmitToken, &id), grpc::StatusCode::OK);
  // read may list, not submit or cancel.
  EXPECT_EQ(ListCode(anonymous.get(), kReadToken), grpc::StatusCode::OK);
  EXPECT_EQ(SubmitCode(anonymous.get(), kReadToken), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(CancelCode(anonymous.get(), kReadToken, id), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(CancelCode(anonymous.get(), kSubmitToken, id), grpc::StatusCode::OK);

  // A client certificate named in the tokens file has that line's role; one
  // that is not named has none.
  auto reader = v1::JobService::NewStub(MakeChannel(address, Client("reader")));
  EXPECT_EQ(ListCode(reader.get(), ""), grpc::StatusCode::OK);
  EXPECT_EQ(SubmitCode(reader.get(), ""), grpc::StatusCode::PERMISSION_DENIED);
  auto unnamed = v1::JobService::NewStub(MakeChannel(address, Client("e2e-client")));
  EXPECT_EQ(ListCode(unnamed.get(), ""), grpc::StatusCode::PERMISSION_DENIED);
  // A worker's certificate is no client's, even when the tokens file names
  // its CN; with a token the token decides.
  auto worker = v1::JobService::NewStub(MakeChannel(address, Client("w1")));
  EXPECT_EQ(ListCode(worker.get(), ""), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(ListCode(worker.get(), kReadToken), grpc::StatusCode::OK);
  std::string denied;
  EXPECT_EQ(
      Run({Bin(kCtl), "--coordinator=" + address, "--tls_ca=" + CertsDir() + "/ca.crt",
           "--tls_cert=" + CertFor("w1") + ".crt", "--tls_key=" + CertFor("w1") + ".key", "list"},
          &denied, absl::Seconds(30), false),
      1)
      << denied;
  EXPECT_THAT(denied, HasSubstr("certificate CN=w1 is a worker's, not a client's"));

  // detourctl: --token_file, $DETOUR_TOKEN, and the error it prints.
  const std::string read_file = WriteFile("read.token", absl::StrCat(kReadToken, "\n"));
  const std::string target = "--coordinator=" + address;
  const std::string ca = absl::StrCat("--tls_ca=", CertsDir(), "/ca.crt");
  std::string out;
  EXPECT_EQ(Run({Bin(kCtl), target, ca, "--token_file=" + read_file, "list"}, &out,
                absl::Seconds(30), false),
            0)
      << out;
  EXPECT_EQ(Run({Bin(kCtl), target, ca, "--token_file=" + read_file, "cancel", id}, &out,
                absl::Seconds(30), false),
            1);
  EXPECT_THAT(out, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(out, HasSubstr("has role read; Cancel needs submit"));
  // The streaming calls carry the token too: watch and events --follow of
  // the cancelled job end with its state, not UNAUTHENTICATED.
  EXPECT_EQ(Run({Bin(kCtl), target, ca, "--token_file=" + read_file, "watch", id}, &out,
                absl::Seconds(30), false),
            1);
  EXPECT_THAT(out, ::testing::Not(HasSubstr("UNAUTHENTICATED")));
  EXPECT_THAT(out, HasSubstr(id + " ended: cancelled"));
  EXPECT_EQ(Run({Bin(kCtl), target, ca, "--token_file=" + read_file, "events", id, "--follow"},
                &out, absl::Seconds(30), false),
            0)
      << out;
  EXPECT_THAT(out, ::testing::Not(HasSubstr("UNAUTHENTICATED")));
  EXPECT_EQ(Run({Bin(kCtl), target, ca, "workers"}, &out, absl::Seconds(30), false), 1);
  EXPECT_THAT(out, HasSubstr("UNAUTHENTICATED"));
  ::setenv("DETOUR_TOKEN", kReadToken, 1);
  EXPECT_EQ(Run({Bin(kCtl), target, ca, "workers"}, &out, absl::Seconds(30), false), 0) << out;
  ::unsetenv("DETOUR_TOKEN");
  // Plaintext to a TLS port does not get through; the hint says why.
  EXPECT_EQ(Run({Bin(kCtl), target, "--insecure", "list"}, &out, absl::Seconds(30), false), 3);
  EXPECT_THAT(out, HasSubstr("speaks TLS: drop --insecure")) << out;
}

// Jobs belong to their submitter, a named token's or a certificate's:
// another submitter cannot cancel them, an admin can, the events say who,
// and `detourctl list --owner` finds them.
TEST_F(TlsTest, JobsBelongToWhoeverSubmittedThem) {
  constexpr char kAlice[] = "alice-token-0123456789abcdef";
  constexpr char kRoot[] = "root-token-0123456789abcdef";
  const std::string tokens = WriteFile(
      "owner_tokens",
      absl::StrCat(kAlice, " submit alice\n", kSubmitToken, " submit\n", kRoot, " admin root\n"));
  Daemon c = StartCoordinator({"--auth_tokens=" + tokens});
  ASSERT_GT(c.grpc_port, 0);
  const std::string address = absl::StrCat("127.0.0.1:", c.grpc_port);
  auto stub = v1::JobService::NewStub(MakeChannel(address, Client()));
  std::string id;
  ASSERT_EQ(SubmitCode(stub.get(), kAlice, &id), grpc::StatusCode::OK);
  EXPECT_EQ(CancelCode(stub.get(), kSubmitToken, id), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(CancelCode(stub.get(), kRoot, id), grpc::StatusCode::OK);
  EXPECT_THAT(c.process->Log(), HasSubstr(absl::StrCat("job ", id, " cancelled by root")));

  const std::string target = "--coordinator=" + address;
  const std::string ca = absl::StrCat("--tls_ca=", CertsDir(), "/ca.crt");
  const std::string token_file = WriteFile("alice.token", absl::StrCat(kAlice, "\n"));
  std::string out;
  EXPECT_EQ(Run({Bin(kCtl), target, ca, "--token_file=" + token_file, "events", id}, &out,
                absl::Seconds(30), false),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("submitted by alice"));
  EXPECT_THAT(out, HasSubstr("cancelled by root"));
  EXPECT_EQ(Run({Bin(kCtl), target, ca, "--token_file=" + token_file, "list", "--owner=alice"},
                &out, absl::Seconds(30), false),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr(id));
  EXPECT_EQ(Run({Bin(kCtl), target, ca, "--token_file=" + token_file, "list", "--owner=bob"}, &out,
                absl::Seconds(30), false),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("no jobs"));
}

TEST_F(TlsTest, WorkerWithACertificateFromAnotherCaCannotRegister) {
  Daemon c = StartCoordinator();
  ASSERT_GT(c.grpc_port, 0);
  const std::string other = OtherCa("w0");
  // The worker trusts both CAs (it would accept the coordinator), but its
  // certificate is from the other one: the coordinator refuses it.
  const std::string both = dir_ + "/both.crt";
  {
    std::ifstream a(CertsDir() + "/ca.crt"), b(other + "/ca.crt");
    std::ofstream(both) << a.rdbuf() << b.rdbuf();
  }
  std::string out;
  EXPECT_EQ(
      Run({Bin(kWorker), "--listen=127.0.0.1:0", "--metrics_port=-1",
           absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port),
           absl::StrCat("--data_dir=", dir_, "/w0"), "--connect_timeout=3s",
           "--tls_cert=" + other + "/w0.crt", "--tls_key=" + other + "/w0.key", "--tls_ca=" + both},
          &out, absl::Seconds(30), false),
      1)
      << out;
  EXPECT_THAT(out, HasSubstr("unreachable"));
  EXPECT_EQ(ListWorkers(c.grpc_port, true).workers_size(), 0);
}

TEST_F(TlsTest, CertificateNamingAnotherWorkerCannotRegisterAsIt) {
  Daemon c = StartCoordinator();
  ASSERT_GT(c.grpc_port, 0);
  const std::string address = absl::StrCat("127.0.0.1:", c.grpc_port);
  auto call = [&](const TransportSecurity& security, const std::string& id,
                  v1::RegisterResponse* response) {
    auto stub = v1::ControlService::NewStub(MakeChannel(address, security));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::RegisterRequest request;
    request.set_worker_id(id);
    request.set_region("Oregon");
    request.set_speed(1000);
    request.set_memory_slots(3);
    request.set_address("127.0.0.1:1");
    return stub->Register(&context, request, response);
  };
  v1::RegisterResponse response;
  grpc::Status s = call(Client("w1"), "w2", &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("the certificate names worker w1, not \"w2\""));
  s = call(Client(), "w2", &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ListWorkers(c.grpc_port, true).workers_size(), 0);
  // Under its own name (or none: the certificate's is taken) it may.
  s = call(Client("w1"), "", &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.worker_id(), "w1");

  // The worker itself refuses a --worker_id its certificate does not carry.
  std::string out;
  const std::string w1 = CertFor("w1");
  EXPECT_EQ(Run({Bin(kWorker), "--worker_id=w2", "--tls_cert=" + w1 + ".crt",
                 "--tls_key=" + w1 + ".key", absl::StrCat("--tls_ca=", CertsDir(), "/ca.crt")},
                &out, absl::Seconds(30), false),
            2);
  EXPECT_THAT(out, HasSubstr("differs from the name in --tls_cert"));
}

// A certificate from the test CA as tools/gen_certs.sh made them before
// identity kinds (no detour:// URI); returns the prefix of its .crt/.key.
std::string UnmarkedCert(const std::string& dir, const std::string& name) {
  const std::string d = dir + "/unmarked";
  const std::string script = absl::StrCat(
      "set -e; mkdir -p ", d, "; cd ", d,
      "; openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out ", name,
      ".key 2>/dev/null; openssl req -new -key ", name, ".key -subj /O=detour/CN=", name, " -out ",
      name, ".csr; printf 'subjectAltName=DNS:", name,
      ",DNS:localhost,IP:127.0.0.1\\nextendedKeyUsage=serverAuth,clientAuth\\n' > ", name,
      ".ext; openssl x509 -req -in ", name, ".csr -CA ", CertsDir(), "/ca.crt -CAkey ", CertsDir(),
      "/ca.key -CAcreateserial -CAserial ca.srl -days 2 -extfile ", name, ".ext -out ", name,
      ".crt 2>/dev/null");
  EXPECT_EQ(std::system(script.c_str()), 0) << script;
  return d + "/" + name;
}

TEST_F(TlsTest, OnlyAWorkerCertificateRegistersAsAWorker) {
  Daemon c = StartCoordinator();
  ASSERT_GT(c.grpc_port, 0);
  auto register_with = [&](int port, const TransportSecurity& security,
                           v1::RegisterResponse* response) {
    auto stub =
        v1::ControlService::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", port), security));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::RegisterRequest request;  // no worker id: the certificate's name
    request.set_region("Oregon");
    request.set_speed(1000);
    request.set_memory_slots(3);
    request.set_address("127.0.0.1:1");
    return stub->Register(&context, request, response);
  };
  v1::RegisterResponse response;
  // A read-only user's certificate from the cluster CA.
  grpc::Status s = register_with(c.grpc_port, Client("reader"), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("certificate CN=reader is a client's"));
  // The coordinator's own.
  s = register_with(c.grpc_port, Client("coordinator"), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("certificate CN=coordinator is a coordinator's"));
  EXPECT_EQ(ListWorkers(c.grpc_port, true).workers_size(), 0);
  // A worker's.
  s = register_with(c.grpc_port, Client("w7"), &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.worker_id(), "w7");

  // A certificate made before identity kinds: refused with what to do, and
  // accepted by a coordinator started with --allow_unmarked_worker_certs.
  const std::string old = UnmarkedCert(dir_, "legacy");
  TlsFiles files;
  files.cert = old + ".crt";
  files.key = old + ".key";
  files.ca = CertsDir() + "/ca.crt";
  auto legacy = TransportSecurity::Load(files, /*client=*/true);
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  s = register_with(c.grpc_port, *legacy, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(),
              HasSubstr("regenerate it with tools/gen_certs.sh DIR --worker legacy"));
  Daemon lenient = StartCoordinator({"--allow_unmarked_worker_certs"}, "lenient");
  ASSERT_GT(lenient.grpc_port, 0);
  s = register_with(lenient.grpc_port, *legacy, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.worker_id(), "legacy");
  s = register_with(lenient.grpc_port, Client("reader"), &response);  // still not a worker
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);

  // A client's certificate naming a registered worker cannot take over its
  // session either (its token alone is not enough).
  const std::string twin = dir_ + "/twin";
  std::string out;
  ASSERT_EQ(Run({"/bin/sh", "-c",
                 absl::StrCat("mkdir -p ", twin, " && cp ", CertsDir(), "/ca.crt ", CertsDir(),
                              "/ca.key ", twin, "/ && ", SourceDir(), "/tools/gen_certs.sh ", twin,
                              " --client w7")},
                &out),
            0)
      << out;
  s = register_with(c.grpc_port, Client("w7"), &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  TlsFiles twin_files;
  twin_files.cert = twin + "/w7.crt";
  twin_files.key = twin + "/w7.key";
  twin_files.ca = CertsDir() + "/ca.crt";
  auto twin_security = TransportSecurity::Load(twin_files, /*client=*/true);
  ASSERT_TRUE(twin_security.ok()) << twin_security.status();
  {
    auto stub = v1::ControlService::NewStub(
        MakeChannel(absl::StrCat("127.0.0.1:", c.grpc_port), *twin_security));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    auto stream = stub->Session(&context);
    v1::WorkerMessage hello;
    hello.set_session_token(response.session_token());
    hello.mutable_heartbeat();
    stream->Write(hello);
    v1::CoordinatorMessage reply;
    while (stream->Read(&reply)) {}
    const grpc::Status ended = stream->Finish();
    EXPECT_EQ(ended.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(ended.error_message(), HasSubstr("certificate CN=w7 is a client's"));
  }

  // A worker daemon given a client's certificate refuses to start.
  const std::string client = CertFor("e2e-client");
  EXPECT_EQ(Run({Bin(kWorker), "--listen=127.0.0.1:0", "--metrics_port=-1",
                 "--tls_cert=" + client + ".crt", "--tls_key=" + client + ".key",
                 absl::StrCat("--tls_ca=", CertsDir(), "/ca.crt")},
                &out, absl::Seconds(30), false),
            2);
  EXPECT_THAT(out, HasSubstr("--tls_cert: certificate CN=e2e-client is a client's"));
}

// Sends one small tensor with `sender` to `address` over a channel with
// `security` — or, with `direct_address`, over the worker's direct transport
// (expecting its certificate to name `worker`) — and returns how the peer
// answered.
absl::Status SendFrame(const std::string& address, const TransportSecurity& security,
                       const std::string& job, const std::string& sender,
                       const std::string& direct_address = "", const std::string& worker = "") {
  PeerSenderOptions options;
  options.ack_timeout = absl::Seconds(10);
  options.security = security;
  options.direct_address = direct_address;
  options.peer_name = worker;
  options.connect_timeout = absl::Seconds(5);
  PeerSender peer(address, direct_address.empty() ? MakeChannel(address, security) : nullptr,
                  options);
  v1::FrameHeader h;
  h.set_job_id(job);
  h.set_direction(v1::DIRECTION_FORWARD);
  h.set_sender(sender);
  h.set_hop(1);
  for (int64_t d : {2, 16, 32}) h.add_shape(d);
  h.set_dtype(v1::DTYPE_FP32);
  auto data =
      std::make_shared<std::vector<float>>(2 * 16 * 32, std::numeric_limits<float>::quiet_NaN());
  TensorView view;
  view.data = data->data();
  view.bytes = data->size() * sizeof(float);
  view.keepalive = data;
  absl::Notification done;
  absl::Status result;
  peer.Send(h, view, [&](absl::Status s, double) {
    result = s;
    done.Notify();
  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  peer.Close();
  return result;
}

double UnauthorizedFrames(int metrics_port) {
  auto scrape = HttpGet(metrics_port, "/metrics");
  if (!scrape.ok()) return -1;
  return MetricValue(*scrape, "detour_activation_frames_unauthorized_total");
}

TEST_F(TlsTest, FrameFromANonMemberIsRejectedAndCounted) {
  TwoWorkerJob run;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkerJob(&run));
  const Daemon& c = run.c;
  const std::vector<Daemon>& workers = run.workers;
  const v1::Job& job = run.job;
  const Daemon& target = workers[1];
  const std::string address = absl::StrCat("127.0.0.1:", target.grpc_port);
  const double before = UnauthorizedFrames(target.metrics_port);
  ASSERT_GE(before, 0);

  // A certificate from the cluster CA, but not a worker of the job.
  absl::Status s = SendFrame(address, Client("outsider"), job.id(), "outsider");
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("is not a member of job " + job.id()));
  // Claiming to be a member it is not certified as ends its stream.
  s = SendFrame(address, Client("outsider"), job.id(), workers[0].id);
  EXPECT_FALSE(s.ok());
  // No certificate at all: refused, 30 times; each is counted, the log
  // says so once and then in summaries (not once per stream).
  for (int i = 0; i < 30; ++i) {
    s = SendFrame(address, Client(), job.id(), workers[0].id);
    EXPECT_FALSE(s.ok());
  }
  EXPECT_TRUE(Eventually([&] { return UnauthorizedFrames(target.metrics_port) >= before + 32; },
                         absl::Seconds(5)))
      << UnauthorizedFrames(target.metrics_port) << " vs " << before;
  int refusal_lines = 0;
  for (absl::string_view line : absl::StrSplit(target.process->Log(), '\n')) {
    if (absl::StrContains(line, "activation stream: refused")) ++refusal_lines;
  }
  EXPECT_GE(refusal_lines, 1);
  EXPECT_LE(refusal_lines, 3) << target.process->Log();
  // Plaintext does not reach the worker at all.
  EXPECT_FALSE(SendFrame(address, TransportSecurity::Insecure(), job.id(), "x").ok());

  // The same through the worker's direct transport (the path its peers use).
  ASSERT_GT(target.data_port, 0);
  const std::string direct = absl::StrCat("127.0.0.1:", target.data_port);
  const double before_direct = UnauthorizedFrames(target.metrics_port);
  s = SendFrame(address, Client("outsider"), job.id(), "outsider", direct, target.id);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("is not a member of job " + job.id()));
  s = SendFrame(address, Client("outsider"), job.id(), workers[0].id, direct, target.id);
  EXPECT_FALSE(s.ok());
  s = SendFrame(address, TransportSecurity::Insecure(), job.id(), workers[0].id, direct, target.id);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(
      Eventually([&] { return UnauthorizedFrames(target.metrics_port) >= before_direct + 3; },
                 absl::Seconds(5)))
      << UnauthorizedFrames(target.metrics_port) << " vs " << before_direct;
  // The job's own tensors travel there: its workers connected.
  auto scrape = HttpGet(target.metrics_port, "/metrics");
  ASSERT_TRUE(scrape.ok());
  EXPECT_THAT(*scrape, HasSubstr("detour_worker_direct_connections_accepted_total "));
  EXPECT_THAT(*scrape, Not(HasSubstr("detour_worker_direct_connections_accepted_total 0\n")));

  // The job was not disturbed.
  const uint64_t at = GetJob(c.grpc_port, job.id()).progress().iteration();
  EXPECT_TRUE(
      Eventually([&] { return GetJob(c.grpc_port, job.id()).progress().iteration() >= at + 2; },
                 absl::Seconds(60)));
  EXPECT_EQ(GetJob(c.grpc_port, job.id()).state(), v1::JOB_STATE_RUNNING);
}

// The sum over reasons of detour_worker_direct_connections_refused_total,
// or -1 when the metrics cannot be read.
// The sum over reasons of a refused-connections counter family.
double RefusedConnections(int metrics_port, absl::string_view family) {
  auto scrape = HttpGet(metrics_port, "/metrics");
  if (!scrape.ok()) return -1;
  double sum = 0;
  bool seen = false;
  const std::string prefix = absl::StrCat(family, "{");
  for (absl::string_view line : absl::StrSplit(*scrape, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    const size_t space = line.rfind(' ');
    double v = 0;
    if (space == absl::string_view::npos || !absl::SimpleAtod(line.substr(space + 1), &v)) {
      return -1;
    }
    sum += v;
    seen = true;
  }
  return seen ? sum : -1;
}

double RefusedDirectConnections(int metrics_port) {
  return RefusedConnections(metrics_port, "detour_worker_direct_connections_refused_total");
}

// A flood of unauthenticated connections against a worker's direct
// transport while a job runs over it: the two workers go on training (the
// peer's connections were authenticated before the flood, and admission
// never closes an authenticated connection to make room), every flood
// connection is refused or closed within the handshake deadline and
// counted, and the log says so in summaries, not once per connection.
TEST_F(TlsTest, AConnectionFloodDoesNotStopTheJob) {
  TwoWorkerJob run;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkerJob(&run));
  const Daemon& c = run.c;
  const std::vector<Daemon>& workers = run.workers;
  const v1::Job& job = run.job;
  const Daemon& target = workers[1];
  ASSERT_GT(target.data_port, 0);
  const double before = RefusedDirectConnections(target.metrics_port);
  ASSERT_GE(before, 0);

  // 200 silent connections from the peer's own address (loopback), held
  // past the 5 s handshake deadline.
  constexpr int kFlood = 200;
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    const int fd = ConnectLoopback(target.data_port);  // and never says a word
    if (fd >= 0) flood.push_back(fd);
  }
  struct Closer {
    std::vector<int>* fds;
    ~Closer() {
      for (int fd : *fds) ::close(fd);
    }
  } closer{&flood};
  EXPECT_GE(flood.size(), static_cast<size_t>(kFlood) * 9 / 10) << "the flood could not connect";
  const uint64_t at = GetJob(c.grpc_port, job.id()).progress().iteration();
  // The job goes on during the flood.
  EXPECT_TRUE(
      Eventually([&] { return GetJob(c.grpc_port, job.id()).progress().iteration() >= at + 2; },
                 absl::Seconds(60)))
      << "iteration " << GetJob(c.grpc_port, job.id()).progress().iteration() << " after " << at;
  // Each flood connection is refused at once or closed at the deadline.
  EXPECT_TRUE(Eventually(
      [&] {
        return RefusedDirectConnections(target.metrics_port) >=
               before + static_cast<double>(flood.size());
      },
      absl::Seconds(20)))
      << RefusedDirectConnections(target.metrics_port) << " refused vs " << before << " + "
      << flood.size();
  const v1::Job now = GetJob(c.grpc_port, job.id());
  EXPECT_EQ(now.state(), v1::JOB_STATE_RUNNING) << now.message();
  EXPECT_EQ(now.progress().members(), 2u);
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(target.process->Log(), '\n')) {
    if (absl::StrContains(line, "direct transport: refused")) ++lines;
  }
  EXPECT_GE(lines, 1) << target.process->Log();
  EXPECT_LE(lines, 10) << "refusals must be logged in summaries:\n" << target.process->Log();
}

// The gRPC ports have the same admission (the daemons' admission relay):
// silent connections from 20 other addresses to the coordinator's and a
// worker's gRPC ports, 10 from each, while the two-worker job trains.
TEST_F(TlsTest, AGrpcPortFloodDoesNotStopTheJob) {
  TwoWorkerJob run;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkerJob(&run));
  const Daemon& c = run.c;
  const Daemon& target = run.workers[1];
  const double coordinator_before =
      RefusedConnections(c.metrics_port, "detour_coordinator_grpc_connections_refused_total");
  const double worker_before =
      RefusedConnections(target.metrics_port, "detour_worker_grpc_connections_refused_total");
  ASSERT_GE(coordinator_before, 0);
  ASSERT_GE(worker_before, 0);

  std::vector<int> flood;
  struct Closer {
    std::vector<int>* fds;
    ~Closer() {
      for (int fd : *fds) ::close(fd);
    }
  } closer{&flood};
  for (int host = 2; host < 22; ++host) {
    for (int i = 0; i < 10; ++i) {
      for (int port : {c.grpc_port, target.grpc_port}) {
        const int fd = ConnectLoopback(port, absl::StrCat("127.0.0.", host));
        if (fd >= 0) flood.push_back(fd);
      }
    }
  }
  EXPECT_GE(flood.size(), 360u) << "the flood could not connect";
  const uint64_t at = GetJob(c.grpc_port, run.job.id()).progress().iteration();
  EXPECT_TRUE(
      Eventually([&] { return GetJob(c.grpc_port, run.job.id()).progress().iteration() >= at + 2; },
                 absl::Seconds(60)))
      << "iteration " << GetJob(c.grpc_port, run.job.id()).progress().iteration() << " after "
      << at;
  // Each address's connections beyond its 8 are refused at once.
  EXPECT_TRUE(Eventually(
      [&] {
        return RefusedConnections(c.metrics_port,
                                  "detour_coordinator_grpc_connections_refused_total") >=
                   coordinator_before + 40 &&
               RefusedConnections(target.metrics_port,
                                  "detour_worker_grpc_connections_refused_total") >=
                   worker_before + 40;
      },
      absl::Seconds(20)));
  const v1::Job now = GetJob(c.grpc_port, run.job.id());
  EXPECT_EQ(now.state(), v1::JOB_STATE_RUNNING) << now.message();
  EXPECT_EQ(now.progress().members(), 2u);
  for (const auto& [daemon, what] :
       {std::pair{&c, "coordinator gRPC: refused"}, std::pair{&target, "worker gRPC: refused"}}) {
    int lines = 0;
    for (absl::string_view line : absl::StrSplit(daemon->process->Log(), '\n')) {
      if (absl::StrContains(line, what)) ++lines;
    }
    EXPECT_GE(lines, 1) << daemon->process->Log();
    EXPECT_LE(lines, 10) << "refusals must be logged in summaries:\n" << daemon->process->Log();
  }
}

TEST_F(TlsTest, InsecureStillWorksWhenAskedFor) {
  tls_ = false;
  Daemon c = StartCoordinator();
  ASSERT_GT(c.grpc_port, 0);
  Daemon w = StartWorker(c.grpc_port, "w1");
  ASSERT_GT(w.grpc_port, 0);
  std::string out;
  ASSERT_EQ(
      Run({Bin(kCtl), absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port), "workers"}, &out), 0)
      << out;
  EXPECT_THAT(out, HasSubstr("idle"));
  // No client authentication in plaintext without --auth_tokens.
  EXPECT_EQ(Submit(c.grpc_port, MicroJob(2, 1, 1, 0.0, 1)).state(), v1::JOB_STATE_PENDING);
}

}  // namespace
}  // namespace detour::testing
