// Link faults over the packet-level WAN test bed (docs/RUNTIME.md §"Link
// faults and partitions"): detour-local --wan runs a coordinator and five
// workers, each in a network namespace of the bed (one data node w1, stage 1
// = {w2, w3}, stage 2 = {w4, w5}, pinned; w3 and w5 in a second region 10 ms
// from the first), and the test cuts links with the
// forwarder's control socket while the job runs:
//
//  - CutLinkBetweenLiveWorkersIsRoutedAround: a stage-1 / stage-2 pair (the
//    one the forwarder saw most traffic on) cut mid-job. On a
//    real network the sends hang (no RST, no FIN) until a timeout: here a
//    direct connection of the pair dies after about 25 s (TCP keep-alive
//    when idle, TCP_USER_TIMEOUT when busy), w2 or w4 reports
//    PeerUnreachable, and 1 s later the
//    coordinator judges the link cut (LINK_CUT), reruns the iteration
//    around it and the job succeeds with every worker still a member.
//  - WorkerCutOffFromTheCoordinatorIsLostThenJoinsAgain: coordinator <-> w3
//    cut both ways: w3 is lost after --worker_silence (5 s in
//    detour-local), the job goes on over w2, and after `restore` w3
//    registers again and joins the job.
//  - CoordinatorCutOffFromHalfTheClusterGoesOnWithTheRest: the same for w3
//    and w5 (the second region, one replica of each stage) at once: w1, w2
//    and w4 carry the job on, and both join again.
//  - CutLinkWithLossAndJitterOnEveryLink: 1 % loss and up to 2 ms of
//    jitter that reorders packets on every link, and w2 <-> w4 cut before
//    the daemons start: the first send's connect fails after the connect
//    timeout (PeerSenderOptions::connect_timeout, 10 s), and the job
//    succeeds around the cut link with every iteration's loss recorded.
//
// Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and /dev/net/tun; skipped
// otherwise. Every run is bounded (`timeout` around detour-local, bounded
// polls); detour-local takes its bed down, and the fixture checks that no
// namespace of its prefix is left and removes any.
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/net/server.h"
#include "common/net/tls.h"
#include "detour/v1/job_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/files.h"
#include "tests/test_paths.h"
#include "tests/wanem/wan_test_support.h"

namespace detour {
namespace {

using ::testing::HasSubstr;
using testing::MissingPrivileges;
using testing::Sh;
using testing::ShellResult;

// Five nodes named like detour-local's workers (worker wI runs in node I),
// so the node ids the wanem control socket takes are the worker ids.
// Two regions, so that the planner has a clear choice of stage-1 / stage-2
// pairs: w2 -> w4 and w3 -> w5 stay within one (2 ms), the other two pairs
// cross (10 ms). On five equal links the full scheduler's columns followed
// the measured links' noise, and a re-plan could leave the pair just cut
// unused (no LINK_CUT to judge; seen once in a clean-clone CI run).
constexpr char kCluster[] = R"({
  "name": "cut5",
  "nodes": [
    { "id": "w1", "region": "A" }, { "id": "w2", "region": "A" },
    { "id": "w3", "region": "B" }, { "id": "w4", "region": "A" },
    { "id": "w5", "region": "B" }
  ],
  "links": [ { "region_a": "A", "region_b": "B", "latency_ms": 10.0,
               "bandwidth_gbytes_per_s": 0.05 } ],
  "intra_region_latency_ms": 2.0,
  "intra_region_bandwidth_gbytes_per_s": 0.05
})";

// A small model (about 0.2 s an iteration here), the full pipeline over a
// pinned assignment and no stage moves, so that the planner can route
// around any one stage-1 / stage-2 pair and the pair stays the same. The
// planner spreads the four microbatches over the pairs by their measured
// links; the test cuts the pair the forwarder's counters show most traffic
// on.
std::string Job(int iterations, const std::string& scheduler = "SCHEDULER_SKIPPIPE") {
  return absl::StrCat(R"({
  "name": "link-fault",
  "model": { "num_layers": 3, "d_model": 64, "num_heads": 2, "context_length": 32 },
  "pipeline": { "num_stages": 3, "data_nodes": 1, "replicas_per_stage": 2,
    "microbatches_per_data_node": 4, "samples_per_microbatch": 2, "memory_slots": 2,
    "scheduler": ")",
                      scheduler, R"(",
    "assignment": [ { "nodes": ["w1"] }, { "nodes": ["w2", "w3"] }, { "nodes": ["w4", "w5"] } ] },
  "elastic": { "reassign_disabled": true },
  "optimizer": { "adamw": { "lr": 1e-3 } },
  "data": { "source": "DATA_SOURCE_EMBEDDED" },
  "iterations": )",
                      iterations, R"(,
  "checkpoint": { "disabled": true },
  "seed": 5,
  "device": "cpu"
})");
}

bool HasEvent(const v1::Job& job, v1::JobHistoryEvent::Kind kind, const std::string& worker = "") {
  for (const v1::JobHistoryEvent& e : job.history()) {
    if (e.kind() == kind && (worker.empty() || e.worker() == worker)) return true;
  }
  return false;
}

std::string History(const v1::Job& job) {
  std::string s;
  for (const v1::JobHistoryEvent& e : job.history()) {
    absl::StrAppend(&s, "  ", v1::JobHistoryEvent::Kind_Name(e.kind()), " it ", e.iteration(), " ",
                    e.worker(), ": ", e.message(), "\n");
  }
  return s;
}

std::string Stages(const v1::Job& job) {
  std::vector<std::string> stages;
  for (const v1::StageNodes& s : job.stages()) stages.push_back(absl::StrJoin(s.nodes(), ","));
  return absl::StrJoin(stages, " | ");
}

bool InStage(const v1::Job& job, int stage, const std::string& worker) {
  if (stage >= job.stages_size()) return false;
  for (const std::string& n : job.stages(stage).nodes()) {
    if (n == worker) return true;
  }
  return false;
}

class LinkFaultWanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    local_ = testing::BuildDir() + "/tools/detour_local/detour-local";
    script_ = testing::BuildDir() + "/tools/wan_testbed.sh";
    prefix_ = absl::StrCat("lf", ::getpid());
    dir_ = absl::StrCat(::testing::TempDir(), "/link_fault_wan_", ::getpid());
    ASSERT_EQ(Sh("rm -rf " + dir_ + " && mkdir -p " + dir_).code, 0);
  }

  void TearDown() override {
    // SIGTERM reaches detour-local through `timeout`, which stops the
    // daemons and takes the bed down; the bed is removed here if that failed.
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      if (!Reap(absl::Seconds(40))) {
        ::kill(pid_, SIGKILL);
        Reap(absl::Seconds(5));
      }
    }
    const ShellResult list = Sh("ip netns list");
    if (list.output.find(prefix_ + "-") != std::string::npos) {
      ADD_FAILURE() << "namespaces left behind:\n" << list.output;
      Sh(absl::StrCat("timeout 30 ", script_, " down --prefix ", prefix_));
    }
    if (HasFailure()) {
      std::cerr << "detour-local's output:\n"
                << ReadFileToString(dir_ + "/local.log").value_or("") << "\ncoordinator.log:\n"
                << ReadFileToString(dir_ + "/out/coordinator.log").value_or("") << "\n";
    }
    Sh("rm -rf " + dir_);
  }

  // Starts detour-local --wan in the background (at most `limit`), then
  // waits for its relay to the coordinator and the job's id. `bed_up` runs
  // once the bed is up, before any daemon starts.
  void Start(int iterations, absl::Duration limit, const std::function<void()>& bed_up = nullptr,
             const std::string& scheduler = "SCHEDULER_SKIPPIPE") {
    ASSERT_EQ(::access(local_.c_str(), X_OK), 0) << local_ << " is not built";
    std::ofstream(dir_ + "/cluster.json") << kCluster;
    std::ofstream(dir_ + "/job.json") << Job(iterations, scheduler);
    const std::string log = dir_ + "/local.log";
    const std::string seconds = absl::StrCat(absl::ToInt64Seconds(limit));
    std::vector<std::string> argv = {"timeout",
                                     "-k",
                                     "5",
                                     seconds,
                                     local_,
                                     "--wan",
                                     "--insecure",
                                     "--wan_prefix",
                                     prefix_,
                                     "--cluster",
                                     dir_ + "/cluster.json",
                                     "--job",
                                     dir_ + "/job.json",
                                     "--out",
                                     dir_ + "/out"};
    pid_ = ::fork();
    ASSERT_GE(pid_, 0);
    if (pid_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      std::vector<char*> args;
      for (std::string& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
    started_ = absl::Now();
    // The relay line: "... 127.0.0.1:PORT from here (a relay)", then "job
    // job-000001 (...)" once submitted.
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    bool bed_seen = false;
    while (absl::Now() < give_up && (address_.empty() || job_id_.empty())) {
      const std::string out = ReadFileToString(log).value_or("");
      if (!bed_seen && out.find("  test bed     ") != std::string::npos) {
        bed_seen = true;
        if (bed_up) bed_up();
      }
      const size_t relay = out.find(" from here (a relay)");
      if (address_.empty() && relay != std::string::npos) {
        const size_t at = out.rfind("127.0.0.1:", relay);
        if (at != std::string::npos) address_ = out.substr(at, relay - at);
      }
      const size_t job = out.find("  job          ");
      if (job != std::string::npos) {
        const size_t begin = job + 15;
        job_id_ = out.substr(begin, out.find(' ', begin) - begin);
      }
      if (!Running()) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_FALSE(address_.empty() || job_id_.empty()) << "detour-local did not submit:\n"
                                                      << ReadFileToString(log).value_or("");
    stub_ = v1::JobService::NewStub(MakeChannel(address_, TransportSecurity::Insecure()));
  }

  bool Running() {
    if (pid_ <= 0) return false;
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      pid_ = -1;
      return false;
    }
    return true;
  }

  // Waits for detour-local to end; false if it still runs after `timeout`.
  bool Reap(absl::Duration timeout) {
    const absl::Time give_up = absl::Now() + timeout;
    while (Running()) {
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return true;
  }

  // The job as the coordinator sees it now; keeps the newest answer in
  // `last_` and remembers every worker ever reported lost.
  std::optional<v1::Job> Get() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::GetJobRequest request;
    request.set_job_id(job_id_);
    v1::Job job;
    if (!stub_->Get(&context, request, &job).ok()) return std::nullopt;
    last_ = job;
    for (const v1::JobHistoryEvent& e : job.history()) {
      if (e.kind() == v1::JobHistoryEvent::KIND_WORKER_LOST) ever_lost_.insert(e.worker());
    }
    return job;
  }

  // Polls the job every 100 ms until `done` holds (true), the job ends or
  // detour-local exits, or `timeout` passes (false).
  bool WaitFor(const std::function<bool(const v1::Job&)>& done, absl::Duration timeout) {
    const absl::Time give_up = absl::Now() + timeout;
    while (absl::Now() < give_up && Running()) {
      if (std::optional<v1::Job> job = Get(); job.has_value()) {
        if (done(*job)) return true;
        if (job->state() == v1::JOB_STATE_SUCCEEDED || job->state() == v1::JOB_STATE_FAILED ||
            job->state() == v1::JOB_STATE_CANCELLED) {
          return false;
        }
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return false;
  }

  // Polls until the job ends: `last_` is then the coordinator's last answer
  // (its history complete) before detour-local stops it.
  void FollowToEnd(absl::Duration timeout) {
    WaitFor([](const v1::Job&) { return false; }, timeout);
  }

  ShellResult Ctl(const std::string& command) {
    return Sh(absl::StrCat("timeout 10 ", script_, " ctl --prefix ", prefix_, " ", command));
  }

  double Since(absl::Time t) const { return absl::ToDoubleSeconds(absl::Now() - t); }

  // loss.csv's data lines.
  size_t IterationsInCsv() const {
    std::vector<std::string> lines = absl::StrSplit(
        ReadFileToString(dir_ + "/out/loss.csv").value_or(""), '\n', absl::SkipEmpty());
    return lines.empty() ? 0 : lines.size() - 1;
  }

  // Bytes each link of the bed delivered so far ("w2 w4" -> bytes), from
  // the forwarder's counters.
  std::map<std::string, int64_t> LinkBytes() {
    std::map<std::string, int64_t> out;
    const ShellResult stats = Ctl("stats");
    for (absl::string_view line : absl::StrSplit(stats.output, '\n', absl::SkipEmpty())) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 4 || !absl::StartsWith(f[3], "delivered_bytes=")) continue;
      int64_t bytes = 0;
      if (absl::SimpleAtoi(f[3].substr(16), &bytes)) out[f[0] + " " + f[1]] = bytes;
    }
    return out;
  }

  void RunCutLinkJob(const std::string& scheduler);
  // A worker of stage 1 or 2 (w2..w5) paired with the other replica of its
  // stage.
  struct Replica {
    std::string worker;
    int stage;
    std::string partner;
  };
  void RunCutOffFromTheCoordinator(const std::vector<Replica>& cut_off);

  std::string local_, script_, prefix_, dir_;
  pid_t pid_ = -1;
  int code_ = -1;
  absl::Time started_;
  std::string address_, job_id_;
  std::unique_ptr<v1::JobService::Stub> stub_;
  v1::Job last_;
  std::set<std::string> ever_lost_;
};

auto Iteration(uint64_t at_least) {
  return [at_least](const v1::Job& j) {
    return j.state() == v1::JOB_STATE_RUNNING && j.progress().iteration() >= at_least;
  };
}

// A used stage-1 / stage-2 pair cut mid-job. Detection, measured: about 26 s
// after the cut.
// A direct connection of the pair dies of ETIMEDOUT ("Connection timed
// out") within about 25 s: an idle one by TCP keep-alive (10 s idle + 3
// probes 5 s apart), a busy one by TCP_USER_TIMEOUT (25 s of unacknowledged
// data; direct_link.cc), which breaks the sender's whole stream at once.
// Then 1 s of judging (the peer's session stays open) before LINK_CUT.
void LinkFaultWanTest::RunCutLinkJob(const std::string& scheduler) {
  constexpr int kIterations = 30;
  // About 8-20 s to start (the link probes), 26 s until the cut is found,
  // 6 s of training, 3 s to stop.
  ASSERT_NO_FATAL_FAILURE(Start(kIterations, absl::Seconds(85), nullptr, scheduler));
  ASSERT_TRUE(WaitFor(Iteration(3), absl::Seconds(30))) << History(last_);
  ASSERT_TRUE(InStage(last_, 1, "w2") && InStage(last_, 2, "w4")) << Stages(last_);
  // The stage-1 / stage-2 pair that carried the most activations over the
  // next iterations: the planner weighs the measured links, which differ a
  // little, and may leave a pair unused.
  const std::map<std::string, int64_t> before = LinkBytes();
  ASSERT_TRUE(WaitFor(Iteration(last_.progress().iteration() + 3), absl::Seconds(30)))
      << History(last_);
  const std::map<std::string, int64_t> after = LinkBytes();
  std::string a = "w2", b = "w4";
  int64_t most = -1;
  for (const char* s1 : {"w2", "w3"}) {
    for (const char* s2 : {"w4", "w5"}) {
      const std::string link = absl::StrCat(s1, " ", s2);
      const int64_t bytes =
          (after.count(link) ? after.at(link) : 0) - (before.count(link) ? before.at(link) : 0);
      if (bytes > most) {
        most = bytes;
        a = s1;
        b = s2;
      }
    }
  }
  std::cout << "cutting " << a << " <-> " << b << " (" << most << " bytes " << a << " -> " << b
            << " over the last iterations)\n";

  // Both directions: forward activations a -> b, gradients b -> a.
  const ShellResult cut = Ctl(absl::StrCat("cut ", a, " ", b, " both"));
  ASSERT_EQ(cut.code, 0) << cut.output;
  const absl::Time cut_at = absl::Now();
  const uint64_t cut_iteration = last_.progress().iteration();
  const bool judged =
      WaitFor([](const v1::Job& j) { return HasEvent(j, v1::JobHistoryEvent::KIND_LINK_CUT); },
              absl::Seconds(75));
  const double detection_s = Since(cut_at);
  ASSERT_TRUE(judged) << "no LINK_CUT " << detection_s << " s after cutting " << a << " <-> " << b
                      << " at iteration " << cut_iteration << ":\n"
                      << History(last_);
  std::cout << "LINK_CUT " << detection_s << " s after the cut (iteration " << cut_iteration
            << ")\n";
  RecordProperty("detection_s", absl::StrCat(detection_s));

  // Every LINK_CUT names the pair, nobody was lost, both stay members.
  for (const v1::JobHistoryEvent& e : last_.history()) {
    if (e.kind() != v1::JobHistoryEvent::KIND_LINK_CUT) continue;
    EXPECT_TRUE(e.worker() == a || e.worker() == b) << e.worker();
    EXPECT_THAT(e.message(),
                ::testing::AnyOf(HasSubstr(absl::StrCat("link ", a, " - ", b, " cut")),
                                 HasSubstr(absl::StrCat("link ", b, " - ", a, " cut"))));
  }
  // Still running after the rerun: the next iterations complete.
  EXPECT_TRUE(WaitFor(Iteration(last_.progress().iteration() + 2), absl::Seconds(20)))
      << History(last_);
  EXPECT_EQ(last_.progress().members(), 5u) << History(last_);
  EXPECT_TRUE(InStage(last_, 1, "w2") && InStage(last_, 2, "w4")) << Stages(last_);

  FollowToEnd(absl::Seconds(40));
  EXPECT_EQ(last_.progress().members(), 5u) << History(last_);
  EXPECT_TRUE(InStage(last_, 1, "w2") && InStage(last_, 2, "w4")) << Stages(last_);
  ASSERT_TRUE(Reap(absl::Seconds(40))) << "detour-local still runs " << Since(started_) << " s in";
  EXPECT_EQ(code_, 0);
  const std::string out = ReadFileToString(dir_ + "/local.log").value_or("");
  EXPECT_THAT(out, HasSubstr(absl::StrCat("SUCCEEDED: trained ", kIterations, " iterations")));
  EXPECT_THAT(out, HasSubstr("test bed " + prefix_ + " is down"));
  EXPECT_EQ(IterationsInCsv(), static_cast<size_t>(kIterations));
  EXPECT_TRUE(ever_lost_.empty()) << "lost: " << absl::StrJoin(ever_lost_, ", ") << "\n"
                                  << History(last_);
  const std::string coordinator = ReadFileToString(dir_ + "/out/coordinator.log").value_or("");
  EXPECT_THAT(coordinator, HasSubstr("link w"));
  EXPECT_THAT(coordinator,
              ::testing::Not(::testing::ContainsRegex("w[0-9] \\(stage [0-9]\\) lost")));
  // The forwarder dropped the pair's packets (counters saved at the end).
  const std::string stats = ReadFileToString(dir_ + "/out/wan/stats.txt").value_or("");
  EXPECT_THAT(stats, ::testing::ContainsRegex(
                         absl::StrCat("(^|\n)", a, " ", b, " [^\n]*dropped_cut=[1-9]")))
      << stats;
  std::cout << "history:\n" << History(last_) << "run took " << Since(started_) << " s\n";
}

TEST_F(LinkFaultWanTest, CutLinkBetweenLiveWorkersIsRoutedAround) {
  if (const std::string why = MissingPrivileges(); !why.empty()) GTEST_SKIP() << why;
  RunCutLinkJob("SCHEDULER_SKIPPIPE");
}

// The same cut under the full scheduler. Its columns are fixed greedily,
// cheapest link first: once the periodic re-plan put measured links into the
// cost model, the column of w2 could be left only w4, across the cut, and w4
// was evicted at iteration 10 in 4 of 5 runs. The runner now lets the route
// search (same skip ratio: still the full model) plan such an iteration.
TEST_F(LinkFaultWanTest, CutLinkIsRoutedAroundUnderTheFullScheduler) {
  if (const std::string why = MissingPrivileges(); !why.empty()) GTEST_SKIP() << why;
  RunCutLinkJob("SCHEDULER_FULL");
}

// The coordinator cut off (both ways) from `cut_off` mid-job, each keeping
// its links to every other worker: each is lost after --worker_silence and
// routed around, its partner keeps the stage, the job trains on; after
// `restore` each registers again and joins a stage, all five are members
// again, and the job succeeds. Nothing
// else is ever lost, and no link is judged cut.
void LinkFaultWanTest::RunCutOffFromTheCoordinator(const std::vector<Replica>& cut_off) {
  constexpr int kIterations = 120;  // about 25 s: the workers must be back before the end
  ASSERT_NO_FATAL_FAILURE(Start(kIterations, absl::Seconds(85)));
  ASSERT_TRUE(WaitFor(Iteration(3), absl::Seconds(30))) << History(last_);
  std::set<std::string> names;
  for (const Replica& r : cut_off) {
    ASSERT_TRUE(InStage(last_, r.stage, r.worker)) << Stages(last_);
    names.insert(r.worker);
  }
  const std::string list = absl::StrJoin(names, ", ");

  for (const Replica& r : cut_off) {
    const ShellResult cut = Ctl("cut coordinator " + r.worker + " both");
    ASSERT_EQ(cut.code, 0) << cut.output;
  }
  const absl::Time cut_at = absl::Now();
  // RUNTIME.md: no heartbeat for --worker_silence (5 s in detour-local), or
  // its session closed past the grace: lost, and routed around.
  ASSERT_TRUE(WaitFor(
      [&](const v1::Job& j) {
        for (const Replica& r : cut_off) {
          if (!HasEvent(j, v1::JobHistoryEvent::KIND_WORKER_LOST, r.worker)) return false;
        }
        return true;
      },
      absl::Seconds(20)))
      << list << " not lost " << Since(cut_at) << " s after the cut:\n"
      << History(last_);
  std::cout << list << " lost " << Since(cut_at) << " s after the cut\n";
  // Job.stages follows at the next plan, a moment after the history.
  const uint32_t members = 5 - static_cast<uint32_t>(cut_off.size());
  EXPECT_TRUE(WaitFor(
      [&](const v1::Job& j) {
        for (const Replica& r : cut_off) {
          if (InStage(j, r.stage, r.worker) || !InStage(j, r.stage, r.partner)) return false;
        }
        return j.progress().members() == members;
      },
      absl::Seconds(10)))
      << Stages(last_) << " members " << last_.progress().members();
  EXPECT_FALSE(HasEvent(last_, v1::JobHistoryEvent::KIND_LINK_CUT)) << History(last_);
  // Nothing wedges: the job trains on without them.
  const uint64_t at_loss = last_.progress().iteration();
  EXPECT_TRUE(WaitFor(Iteration(at_loss + 3), absl::Seconds(15))) << History(last_);

  // Healed: they reach the coordinator again, are idle and join (the job
  // is short of its spec's workers), each into a stage short of a replica
  // (with two back at once, either may take either stage).
  for (const Replica& r : cut_off) {
    const ShellResult restore = Ctl("restore coordinator " + r.worker + " both");
    ASSERT_EQ(restore.code, 0) << restore.output;
  }
  const absl::Time restored_at = absl::Now();
  EXPECT_TRUE(WaitFor(
      [&](const v1::Job& j) {
        for (const Replica& r : cut_off) {
          // One back: the stage it left is the one short of a replica.
          const bool placed = cut_off.size() == 1
                                  ? InStage(j, r.stage, r.worker)
                                  : InStage(j, 1, r.worker) || InStage(j, 2, r.worker);
          if (!HasEvent(j, v1::JobHistoryEvent::KIND_WORKER_JOINED, r.worker) || !placed) {
            return false;
          }
        }
        return j.progress().members() == 5u;
      },
      absl::Seconds(30)))
      << list << " did not join again " << Since(restored_at) << " s after the restore:\n"
      << History(last_) << Stages(last_);
  std::cout << list << " joined again " << Since(restored_at) << " s after the restore\n";
  EXPECT_EQ(ever_lost_, names) << History(last_);

  FollowToEnd(absl::Seconds(60));
  ASSERT_TRUE(Reap(absl::Seconds(60))) << "detour-local still runs " << Since(started_) << " s in";
  EXPECT_EQ(code_, 0);
  const std::string out = ReadFileToString(dir_ + "/local.log").value_or("");
  EXPECT_THAT(out, HasSubstr(absl::StrCat("SUCCEEDED: trained ", kIterations, " iterations")));
  EXPECT_THAT(out, HasSubstr("test bed " + prefix_ + " is down"));
  std::cout << "run took " << Since(started_) << " s\n";
}

TEST_F(LinkFaultWanTest, WorkerCutOffFromTheCoordinatorIsLostThenJoinsAgain) {
  if (const std::string why = MissingPrivileges(); !why.empty()) GTEST_SKIP() << why;
  // w3 keeps its links to w1, w2, w4 and w5.
  RunCutOffFromTheCoordinator({{"w3", 1, "w2"}});
}

// Half the cluster: the second region's workers (w3 of stage 1, w5 of stage
// 2) cut off from the coordinator at once. The first region's (w1, w2, w4)
// carry the job on; both come back.
TEST_F(LinkFaultWanTest, CoordinatorCutOffFromHalfTheClusterGoesOnWithTheRest) {
  if (const std::string why = MissingPrivileges(); !why.empty()) GTEST_SKIP() << why;
  RunCutOffFromTheCoordinator({{"w3", 1, "w2"}, {"w5", 2, "w4"}});
}

TEST_F(LinkFaultWanTest, CutLinkWithLossAndJitterOnEveryLink) {
  if (const std::string why = MissingPrivileges(); !why.empty()) GTEST_SKIP() << why;
  constexpr int kIterations = 30;
  // Once the bed is up, before the daemons start: w2 has no connection to
  // w4 yet, so its first send fails at the connect timeout rather than the
  // ack timeout.
  ShellResult loss{-1, ""}, cut{-1, ""}, shown{-1, ""};
  absl::Time cut_at;
  ASSERT_NO_FATAL_FAILURE(Start(kIterations, absl::Seconds(85), [&] {
    loss = Ctl("set '*' '*' loss=0.01 jitter_ms=2 reorder=1");
    cut = Ctl("cut w2 w4 both");
    shown = Ctl("show w2 w3 both");
    cut_at = absl::Now();
  }));
  ASSERT_EQ(loss.code, 0) << loss.output;
  ASSERT_EQ(cut.code, 0) << cut.output;
  // The forwarder holds the jitter and the reordering on the links.
  ASSERT_EQ(shown.code, 0) << shown.output;
  EXPECT_THAT(shown.output, ::testing::ContainsRegex("w2 w3 [^\n]*jitter_ms=2 [^\n]*loss=0.01"))
      << shown.output;
  EXPECT_THAT(shown.output, ::testing::ContainsRegex("w3 w2 [^\n]*reorder=1")) << shown.output;
  ASSERT_TRUE(
      WaitFor([](const v1::Job& j) { return HasEvent(j, v1::JobHistoryEvent::KIND_LINK_CUT); },
              absl::Seconds(45)))
      << "no LINK_CUT " << Since(cut_at) << " s after cutting w2 <-> w4:\n"
      << History(last_);
  std::cout << "LINK_CUT " << Since(cut_at) << " s after the cut\n";
  EXPECT_EQ(last_.progress().members(), 5u) << History(last_);

  FollowToEnd(absl::Seconds(50));
  ASSERT_TRUE(Reap(absl::Seconds(50))) << "detour-local still runs " << Since(started_) << " s in";
  EXPECT_EQ(code_, 0);
  const std::string out = ReadFileToString(dir_ + "/local.log").value_or("");
  EXPECT_THAT(out, HasSubstr(absl::StrCat("SUCCEEDED: trained ", kIterations, " iterations")));
  EXPECT_EQ(IterationsInCsv(), static_cast<size_t>(kIterations));
  EXPECT_TRUE(ever_lost_.empty()) << "lost: " << absl::StrJoin(ever_lost_, ", ") << "\n"
                                  << History(last_);
  // Packets were lost on the links the job used, and the cut pair dropped.
  const std::string stats = ReadFileToString(dir_ + "/out/wan/stats.txt").value_or("");
  EXPECT_THAT(stats, ::testing::ContainsRegex("dropped_loss=[1-9]")) << stats;
  EXPECT_THAT(stats, ::testing::ContainsRegex("(^|\n)w2 w4 [^\n]*dropped_cut=[1-9]")) << stats;
  std::cout << "run took " << Since(started_) << " s\n";
}

}  // namespace
}  // namespace detour
