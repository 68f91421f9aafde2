// End-to-end, everyday use: every program takes `--name
// value` as well as `--name=value`, subcommand help names its positional
// arguments, `detourctl watch --json` writes JSON Lines and says why a job
// waits, SIGTERM/SIGINT stop the daemons in every state (a worker still
// retrying its first connection included), and two workers on one host do
// not collide on ports by default.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/e2e/local_cluster.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::string kLocal = "tools/detour_local/detour-local";
const std::string kSim = "tools/detour_sim/detour-sim";
const std::string kEval = "tools/detour_eval/detour-eval";
const std::string kTrain = "tools/detour_train/detour-train";

// Whether 127.0.0.1:port can be bound now.
bool PortFree(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

// Flag forms, help, signals and ports: plaintext (--insecure) daemons and
// clients; tls_test.cc covers the security rules.
class CliTest : public E2eTest {
 protected:
  CliTest() { tls_ = false; }
  // Runs argv with `--flag value` and again with `--flag=value` (the pair at
  // `at`); both must exit `code` with the same output, which must hold
  // `expect`.
  void BothForms(std::vector<std::string> argv, size_t at, int code, const std::string& expect) {
    std::string spaced;
    EXPECT_EQ(Run(argv, &spaced), code) << absl::StrJoin(argv, " ") << "\n" << spaced;
    EXPECT_THAT(spaced, HasSubstr(expect)) << absl::StrJoin(argv, " ");
    argv[at] = absl::StrCat(argv[at], "=", argv[at + 1]);
    argv.erase(argv.begin() + static_cast<long>(at) + 1);
    std::string joined;
    EXPECT_EQ(Run(argv, &joined), code) << absl::StrJoin(argv, " ") << "\n" << joined;
    EXPECT_EQ(spaced, joined) << absl::StrJoin(argv, " ");
  }

  std::string TinyJob(const std::string& name, int stages, int replicas) {
    const std::string path = absl::StrCat(dir_, "/", name, ".json");
    std::ofstream(path) << absl::StrCat(
        R"({"name": ")", name, R"(", "model": {"num_layers": 4, "d_model": 32,
        "num_heads": 2, "ffn_dim": 64, "context_length": 16},
        "pipeline": {"num_stages": )",
        stages, R"(, "data_nodes": 2, "replicas_per_stage": )", replicas,
        R"(, "microbatches_per_data_node": 2, "samples_per_microbatch": 2},
        "iterations": 1000000})");
    return path;
  }
};

TEST_F(CliTest, EveryProgramTakesBothFlagForms) {
  Daemon c = StartCoordinator();
  const std::string address = absl::StrCat("127.0.0.1:", c.grpc_port);
  // detourctl: global flags before or after the command, in both forms
  // (`detourctl workers --coordinator HOST:PORT` was refused).
  BothForms({Bin(kCtl), "workers", "--coordinator", address}, 2, 0, "no workers registered");
  BothForms({Bin(kCtl), "--coordinator", address, "list"}, 1, 0, "no jobs");
  BothForms({Bin(kCtl), "list", "--state", "running", "--coordinator", address}, 2, 0, "no jobs");
  BothForms({Bin(kCtl), "get", "--coordinator", address, "job-424242"}, 2, 1,
            "no job \"job-424242\"");
  BothForms({Bin(kCtl), "health", "--target", address}, 2, 0, "SERVING");
  BothForms({Bin(kCtl), "workers", "--timeout", "soon"}, 2, 2, "--timeout: \"soon\"");
  // The daemons.
  BothForms({Bin(kCoordinator), "--worker_silence", "never"}, 1, 2,
            "--worker_silence: \"never\" is not a duration");
  BothForms({Bin(kWorker), "--device", "tpu"}, 1, 2, "--device: \"tpu\" is not cpu or cuda");
  BothForms({Bin(kWorker), "--port_offset", "5000", "--listen=127.0.0.1:65000"}, 1, 2,
            "--port_offset: 5000 is not in [0, 1024]");
  BothForms({Bin(kWorker), "--port_offset", "600", "--listen=127.0.0.1:65000"}, 1, 2,
            "--port_offset: 600 takes --listen's port 65000 past 65535");
  // The tools.
  BothForms({Bin(kLocal), "--job", "/nonexistent/job.json", "--out", dir_ + "/local"}, 1, 2,
            "nonexistent");
  BothForms({Bin(kSim), "plan", "--cluster", "/nonexistent/c.json", "--job", "/x.json"}, 2, 1,
            "nonexistent");
  BothForms({Bin(kEval), "--split", "0", "--preset", "tiny"}, 1, 2, "--split: bad value \"0\"");
  BothForms({Bin(kTrain), "--iterations", "0"}, 1, 2, "--iterations: bad value \"0\"");
  BothForms({Bin(kTrain), "--precision", "fp16"}, 1, 2, "--precision: bad value \"fp16\"");
  // --version everywhere.
  for (const std::string& bin : {kCoordinator, kWorker, kCtl, kLocal, kSim, kEval, kTrain}) {
    std::string out;
    EXPECT_EQ(Run({Bin(bin), "--version"}, &out), 0) << bin << ": " << out;
    EXPECT_THAT(out, HasSubstr(" 0.")) << bin;
  }
}

TEST_F(CliTest, CommandHelpNamesPositionalArguments) {
  struct Case {
    std::string command;
    std::string usage;
  };
  const Case cases[] = {
      {"get", "Usage: detourctl get [flags] JOB_ID\n"},
      {"watch", "Usage: detourctl watch [flags] JOB_ID\n"},
      {"cancel", "Usage: detourctl cancel [flags] JOB_ID\n"},
      {"resume", "Usage: detourctl resume [flags] JOB_ID\n"},
      {"events", "Usage: detourctl events [flags] JOB_ID\n"},
      {"submit", "Usage: detourctl submit [flags] SPEC.json\n"},
      {"workers", "Usage: detourctl workers [flags]\n"},
  };
  for (const Case& c : cases) {
    std::string out;
    EXPECT_EQ(Run({Bin(kCtl), c.command, "--help"}, &out), 0) << c.command;
    EXPECT_THAT(out, HasSubstr(c.usage)) << out;
    // The global flags are listed (and accepted) after the command too.
    EXPECT_THAT(out, HasSubstr("--coordinator")) << c.command;
    if (c.usage.find("JOB_ID") != std::string::npos) {
      EXPECT_THAT(out, HasSubstr("Arguments:\n  JOB_ID\n")) << c.command;
    }
  }
}

// The README's first run: two workers, a job that needs eight. `watch` says
// why it waits, `--json` writes one parseable JobEvent per line, and the
// cancelled job ends without an ETA.
TEST_F(CliTest, WatchSaysWhyAJobWaitsAndWritesJsonLines) {
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 2, {"--torch_threads=1"});
  const std::string address = absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port);
  std::string out;
  ASSERT_EQ(Run({Bin(kCtl), address, "submit", TinyJob("eight", 4, 2)}, &out), 0) << out;
  const std::string id = out.substr(10, out.find(' ', 10) - 10);  // "submitted ID (...)"
  const std::string why =
      "waiting for workers: needs 8 (2 data nodes + 3 stages × 2 replicas), 2 registered; it "
      "cannot start until 6 more register";
  ASSERT_TRUE(
      Eventually([&] { return GetJob(c.grpc_port, id).message() == why; }, absl::Seconds(10)))
      << GetJob(c.grpc_port, id).message();

  ChildProcess text;
  ASSERT_TRUE(
      text.Start({Bin(kCtl), "--insecure", address, "watch", id}, dir_ + "/watch.log").ok());
  ChildProcess json;
  ASSERT_TRUE(
      json.Start({Bin(kCtl), "watch", id, "--json", "--insecure", address}, dir_ + "/watch.jsonl")
          .ok());
  ASSERT_TRUE(Eventually(
      [&] {
        return text.Log().find('\n') != std::string::npos &&
               json.Log().find('\n') != std::string::npos;
      },
      absl::Seconds(10)));
  EXPECT_THAT(text.Log(), HasSubstr(absl::StrCat(id, " pending  0/1000000  (", why, ")")));
  ASSERT_EQ(Run({Bin(kCtl), address, "cancel", id}, &out), 0) << out;
  EXPECT_EQ(text.Wait(absl::Seconds(10)), 1);  // the job did not succeed
  EXPECT_EQ(json.Wait(absl::Seconds(10)), 1);
  EXPECT_THAT(text.Log(), HasSubstr(absl::StrCat(id, " ended: cancelled")));
  const std::vector<std::string> lines = absl::StrSplit(json.Log(), '\n', absl::SkipEmpty());
  ASSERT_GE(lines.size(), 2u) << json.Log();
  v1::JobEvent last;
  for (const std::string& line : lines) {
    ASSERT_EQ(line.front(), '{') << line;
    ASSERT_EQ(line.back(), '}') << line;
    v1::JobEvent event;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(line, &event).ok()) << line;
    last = event;
  }
  EXPECT_EQ(last.job().state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(last.job().progress().eta_s(), 0);
  EXPECT_THAT(text.Log(), Not(HasSubstr("eta")));
}

TEST_F(CliTest, DaemonsStopOnSignalsInEveryState) {
  for (int sig : {SIGTERM, SIGINT}) {
    SCOPED_TRACE(sig == SIGTERM ? "SIGTERM" : "SIGINT");
    // A worker whose coordinator is not there yet: it retries forever
    // (--connect_timeout 0) and used to ignore both signals.
    auto [fd, port] = OccupyPort();
    ::close(fd);
    ChildProcess retrying;
    ASSERT_TRUE(retrying
                    .Start({Bin(kWorker), "--insecure", "--listen=127.0.0.1:0", "--metrics_port=-1",
                            absl::StrCat("--coordinator=127.0.0.1:", port),
                            absl::StrCat("--data_dir=", dir_, "/retrying")},
                           absl::StrCat(dir_, "/retrying", sig, ".log"))
                    .ok());
    ASSERT_TRUE(Eventually([&] { return retrying.Log().find("retrying in") != std::string::npos; },
                           absl::Seconds(20)))
        << retrying.Log();
    const absl::Time sent = absl::Now();
    retrying.Signal(sig);
    EXPECT_EQ(retrying.Wait(absl::Seconds(10)), 0) << retrying.Log();
    EXPECT_LT(absl::Now() - sent, absl::Seconds(5));
    EXPECT_THAT(retrying.Log(), HasSubstr("while registering with the coordinator; stopping"));

    // Serving, idle, and with a pending job.
    Daemon c = StartCoordinator({}, absl::StrCat("c", sig));
    Daemon w = StartWorker(c.grpc_port, absl::StrCat("w", sig));
    Submit(c.grpc_port, [] {
      v1::JobSpec spec;
      spec.set_name("waits");
      spec.mutable_model()->set_preset("tiny");
      spec.set_iterations(5);
      return spec;
    }());
    w.process->Signal(sig);
    EXPECT_EQ(w.process->Wait(absl::Seconds(15)), 0) << w.process->Log();
    c.process->Signal(sig);
    EXPECT_EQ(c.process->Wait(absl::Seconds(15)), 0) << c.process->Log();
  }
}

// Two workers on one host with default metrics ports: the second one used to
// fail on 9471. The default follows the gRPC port (+2400), and --port_offset
// (what detour-worker@N passes) moves both. The data ports (+1200) follow
// too, so the block must have those free as well (once in CI another test's
// process held the second worker's).
TEST_F(CliTest, TwoWorkersOnOneHostDoNotCollide) {
  Daemon c = StartCoordinator();
  int base = 0;
  for (int tries = 0; tries < 50 && base == 0; ++tries) {
    auto [fd, port] = OccupyPort();
    ::close(fd);
    bool all_free = port + 2401 <= 65535;
    for (int offset : {0, 1200, 2400}) {
      all_free = all_free && PortFree(port + offset) && PortFree(port + offset + 1);
    }
    if (all_free) base = port;
  }
  ASSERT_GT(base, 0) << "no free block of ports";
  // StartWorker passes --metrics_port=0; these run with the defaults.
  auto start = [&](const std::string& name, std::vector<std::string> extra) {
    Daemon d;
    const std::string ready = absl::StrCat(dir_, "/", name, ".ready");
    std::vector<std::string> argv = {Bin(kWorker),
                                     "--insecure",
                                     absl::StrCat("--listen=127.0.0.1:", base),
                                     "--metrics_bind=127.0.0.1",
                                     absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port),
                                     absl::StrCat("--data_dir=", dir_, "/", name),
                                     absl::StrCat("--ready_file=", ready)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    EXPECT_TRUE(d.process->Start(argv, absl::StrCat(dir_, "/", name, ".log")).ok());
    auto grpc = WaitForReadyField(ready, "grpc_port", absl::Seconds(20));
    EXPECT_TRUE(grpc.ok()) << d.process->Log();
    auto metrics = WaitForReadyField(ready, "metrics_port", absl::Seconds(1));
    if (grpc.ok()) {
      EXPECT_TRUE(absl::SimpleAtoi(*grpc, &d.grpc_port));
    }
    if (metrics.ok()) {
      EXPECT_TRUE(absl::SimpleAtoi(*metrics, &d.metrics_port));
    }
    return d;
  };
  Daemon first = start("gpu0", {});
  Daemon second = start("gpu1", {"--port_offset=1"});
  EXPECT_EQ(first.grpc_port, base);
  EXPECT_EQ(first.metrics_port, base + 2400);
  EXPECT_EQ(second.grpc_port, base + 1);
  EXPECT_EQ(second.metrics_port, base + 2401);
  EXPECT_EQ(ListWorkers(c.grpc_port, false).workers_size(), 2);
  auto scrape = HttpGet(second.metrics_port, "/healthz");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_THAT(*scrape, HasSubstr("200"));
}

}  // namespace
}  // namespace detour::testing
