// End-to-end tests of the detour-sim binary: runs it as a process.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/test_paths.h"

namespace detour {
namespace {

using detour::testing::BuildDir;
using detour::testing::SourceDir;

struct SimRun {
  int code = -1;
  std::string out;  // stdout and stderr
};

SimRun Sim(const std::string& args, bool merge_stderr = true) {
  const std::string cmd = absl::StrCat(BuildDir(), "/tools/detour_sim/detour-sim ", args,
                                       merge_stderr ? " 2>&1" : " 2>/dev/null");
  SimRun r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.out.append(buf, n);
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string Example() {
  return absl::StrCat("--cluster ", SourceDir(), "/examples/clusters/geo20.json --job ",
                      SourceDir(), "/examples/jobs/geo20_1.5b.json");
}

// Per-process names: ctest runs this binary's tests in parallel.
std::string Temp(const std::string& name) { return detour::testing::ProcessTempDir() + "/" + name; }

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

google::protobuf::Struct ParseObject(const std::string& json) {
  google::protobuf::Struct s;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(json, &s).ok()) << json.substr(0, 500);
  return s;
}

TEST(DetourSimCliTest, HelpAndUsageErrors) {
  SimRun help = Sim("--help");
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("detour-sim plan"), std::string::npos);
  EXPECT_EQ(Sim("").code, 2);
  SimRun bad = Sim("plan --cluster x.json");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("--job is required"), std::string::npos) << bad.out;
  EXPECT_EQ(Sim(absl::StrCat("plan ", Example(), " --bogus")).code, 2);
  // Flags come from common/flags.h: did-you-mean, per-command generated help,
  // a flag of another command named as such.
  SimRun typo = Sim(absl::StrCat("plan ", Example(), " --shceduler full"));
  EXPECT_EQ(typo.code, 2);
  EXPECT_NE(typo.out.find("did you mean --scheduler?"), std::string::npos) << typo.out;
  SimRun plan_help = Sim("plan --help");
  EXPECT_EQ(plan_help.code, 0);
  EXPECT_NE(plan_help.out.find("--evaluations (int, default -1)"), std::string::npos)
      << plan_help.out;
  SimRun routes = Sim(absl::StrCat("plan ", Example(), " --routes r.json"));
  EXPECT_EQ(routes.code, 2);
  EXPECT_NE(routes.out.find("--routes only goes with simulate"), std::string::npos) << routes.out;
  SimRun svg = Sim(absl::StrCat("compare ", Example(), " --svg x.svg"));
  EXPECT_EQ(svg.code, 2);
  EXPECT_NE(svg.out.find("--svg-dir"), std::string::npos) << svg.out;
  EXPECT_EQ(Sim(absl::StrCat("plan ", Example(), " stray")).code, 2);
  SimRun sched = Sim(absl::StrCat("plan ", Example(), " --scheduler fastest"));
  EXPECT_EQ(sched.code, 1);
  EXPECT_NE(sched.out.find("unknown scheduler"), std::string::npos) << sched.out;
}

TEST(DetourSimCliTest, CompareTableOnShippedExample) {
  SimRun r = Sim(absl::StrCat("compare ", Example()));
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* s : {"full", "random", "skip-no-collision", "skippipe", "vs full", "1.00x"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  }
}

TEST(DetourSimCliTest, PlanJsonRoundTripsThroughSimulate) {
  const std::string trace = Temp("plan_trace.json");
  const std::string svg = Temp("plan.svg");
  SimRun plan = Sim(absl::StrCat("plan ", Example(), " --json --trace ", trace, " --svg ", svg),
                    /*merge_stderr=*/false);
  ASSERT_EQ(plan.code, 0) << plan.out;
  google::protobuf::Struct report = ParseObject(plan.out);
  const auto& f = report.fields();
  for (const char* key : {"scheduler", "iteration_time_s", "pipeline_time_s", "utilization",
                          "planning_time_s", "stages", "routes"}) {
    EXPECT_TRUE(f.count(key)) << key;
  }
  EXPECT_EQ(f.at("scheduler").string_value(), "skippipe");
  EXPECT_EQ(f.at("stages").list_value().values_size(), 6);
  EXPECT_EQ(f.at("stages").list_value().values(0).list_value().values_size(), 5);
  const auto& routes = f.at("routes").list_value().values();
  ASSERT_EQ(routes.size(), 30);
  const auto& r0 = routes[0].struct_value().fields();
  EXPECT_EQ(r0.at("microbatch").number_value(), 0);
  EXPECT_EQ(r0.at("nodes").list_value().values_size(), 4);
  EXPECT_EQ(r0.at("stages").list_value().values(0).number_value(), 0);
  EXPECT_EQ(r0.at("data_node").string_value(),
            r0.at("nodes").list_value().values(0).string_value());

  // Trace and SVG were written and look right.
  google::protobuf::Struct t = ParseObject(Read(trace));
  EXPECT_GT(t.fields().at("traceEvents").list_value().values_size(), 100);
  const std::string picture = Read(svg);
  EXPECT_EQ(picture.rfind("<svg", 0), 0u);
  EXPECT_NE(picture.find("idle (bubble)"), std::string::npos);

  const std::string routes_file = Temp("routes.json");
  Write(routes_file, plan.out);
  SimRun sim = Sim(absl::StrCat("simulate ", Example(), " --routes ", routes_file, " --json"),
                   /*merge_stderr=*/false);
  ASSERT_EQ(sim.code, 0) << sim.out;
  google::protobuf::Struct again = ParseObject(sim.out);
  EXPECT_DOUBLE_EQ(again.fields().at("pipeline_time_s").number_value(),
                   f.at("pipeline_time_s").number_value());
  EXPECT_DOUBLE_EQ(again.fields().at("iteration_time_s").number_value(),
                   f.at("iteration_time_s").number_value());

  // Unknown node in the routes.
  const std::string first_node = r0.at("nodes").list_value().values(1).string_value();
  std::string ghost = plan.out;
  const std::string needle = absl::StrCat("\"", first_node, "\"");
  ghost.replace(ghost.find(needle, ghost.find("\"routes\"")), needle.size(), "\"ghost\"");
  Write(routes_file, ghost);
  SimRun bad = Sim(absl::StrCat("simulate ", Example(), " --routes ", routes_file));
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.out.find("unknown node \"ghost\""), std::string::npos) << bad.out;

  // A violated constraint: the full pipeline's routes under skip rules.
  SimRun full = Sim(absl::StrCat("plan ", Example(), " --scheduler full --json"), false);
  ASSERT_EQ(full.code, 0);
  Write(routes_file, absl::StrReplaceAll(
                         full.out, {{"\"scheduler\": \"full\"", "\"scheduler\": \"skippipe\""}}));
  SimRun broken = Sim(absl::StrCat("simulate ", Example(), " --routes ", routes_file));
  EXPECT_EQ(broken.code, 1);
  EXPECT_NE(broken.out.find("visits 6 stages, the skip ratio asks for 4"), std::string::npos)
      << broken.out;
}

std::string Reference() {
  return absl::StrCat("--cluster ", SourceDir(), "/examples/clusters/skippipe_ref20.json --job ",
                      SourceDir(), "/examples/jobs/skippipe_ref20.json");
}

// --assignment pins the partition (node indices or ids, data nodes first);
// the plan reports exactly it, and --queue/--objective/--evaluations shape
// the search. Bad pins are usage errors naming the flag.
TEST(DetourSimCliTest, AssignmentPinsThePartition) {
  const std::string pin = "0,3,4,10,11;15,8,14;1,9,6;16,12,13;5,18,7;n17,n2,n19";
  SimRun r = Sim(absl::StrCat("plan ", Reference(), " --assignment \"", pin,
                              "\" --objective pipeline --contention none --evaluations 200 --json"),
                 /*merge_stderr=*/false);
  ASSERT_EQ(r.code, 0) << r.out;
  google::protobuf::Value v;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &v).ok()) << r.out;
  const auto& stages = v.struct_value().fields().at("stages").list_value().values();
  ASSERT_EQ(stages.size(), 6);
  std::vector<std::vector<std::string>> got;
  for (const auto& g : stages) {
    got.emplace_back();
    for (const auto& id : g.list_value().values()) got.back().push_back(id.string_value());
    std::sort(got.back().begin(), got.back().end());
  }
  EXPECT_EQ(got[0], (std::vector<std::string>{"n0", "n10", "n11", "n3", "n4"}));
  EXPECT_EQ(got[5], (std::vector<std::string>{"n17", "n19", "n2"}));

  struct Bad {
    std::string pin, message;
  } bad[] = {
      {"0,3,4;15,8,14", "--assignment: pipeline.assignment: 2 stage groups for 6 stages"},
      {"0,3,4,10,11;15,8;1,9,6;16,12,13;5,18,7;17,2,19",
       "pipeline.assignment[1]: 2 nodes, stage 1 needs 3"},
      {"0,3,4,10,99;15,8,14;1,9,6;16,12,13;5,18,7;17,2,19",
       "--assignment: node index 99 outside [0, 20)"},
      {"0,3,4,10,w9;15,8,14;1,9,6;16,12,13;5,18,7;17,2,19",
       "--assignment: \"w9\" is not a node of the cluster"},
      {"0,3,4,10,11;15,8,14;1,9,6;16,12,13;5,18,7;17,2,0", "node \"n0\" is assigned twice"},
  };
  for (const Bad& b : bad) {
    SimRun e = Sim(absl::StrCat("plan ", Reference(), " --assignment \"", b.pin, "\""));
    EXPECT_EQ(e.code, 2) << b.pin << ": " << e.out;
    EXPECT_NE(e.out.find(b.message), std::string::npos) << b.pin << ": " << e.out;
  }
  SimRun q = Sim(absl::StrCat("plan ", Reference(), " --queue sideways"));
  EXPECT_EQ(q.code, 2);
  EXPECT_NE(q.out.find("--queue: arrival or backward-first, got sideways"), std::string::npos)
      << q.out;
  SimRun o = Sim(absl::StrCat("simulate ", Reference(), " --objective pipeline --routes x"));
  EXPECT_EQ(o.code, 2);
  EXPECT_NE(o.out.find("--objective only goes with plan, compare"), std::string::npos) << o.out;
}

// The reference's published paths (a route file) still simulate, and the
// text report names both queue policies.
TEST(DetourSimCliTest, SimulatesTheReferencePaths) {
  SimRun r = Sim(absl::StrCat("simulate ", Reference(), " --contention none --routes ", SourceDir(),
                              "/examples/routes/skippipe_ref20_ca.json"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("pipeline 32.484 s"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("under backward-first: pipeline 32.924 s"), std::string::npos) << r.out;
}

TEST(DetourSimCliTest, BadClustersAreRefused) {
  const std::string job = Temp("job.json");
  Write(job, R"({"name": "j", "iterations": 1, "model": {"preset": "tiny"},
                 "pipeline": {"num_stages": 2}})");
  const std::string missing = Temp("missing_pair.json");
  Write(missing, R"({"name": "c", "nodes": [{"id": "a", "region": "x"}, {"id": "b", "region": "y"},
                     {"id": "c", "region": "z"}],
                     "links": [{"region_a": "x", "region_b": "y", "latency_ms": 10,
                                "bandwidth_gbytes_per_s": 1}]})");
  SimRun r = Sim(absl::StrCat("plan --cluster ", missing, " --job ", job));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("z"), std::string::npos) << r.out;

  const std::string zero = Temp("zero_bw.json");
  Write(zero, R"({"name": "c", "nodes": [{"id": "a", "region": "x"}, {"id": "b", "region": "y"}],
                  "links": [{"region_a": "x", "region_b": "y", "latency_ms": 10,
                             "bandwidth_gbytes_per_s": 0}]})");
  r = Sim(absl::StrCat("plan --cluster ", zero, " --job ", job));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("bandwidth"), std::string::npos) << r.out;

  r = Sim(absl::StrCat("plan --cluster ", Temp("nope.json"), " --job ", job));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("nope.json"), std::string::npos) << r.out;

  // Too few nodes for the pipeline.
  const std::string small = Temp("small.json");
  Write(small, R"({"name": "c", "nodes": [{"id": "a", "region": "x"}]})");
  r = Sim(absl::StrCat("plan --cluster ", small, " --job ", job));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("needs"), std::string::npos) << r.out;
}

TEST(DetourSimCliTest, KfacSyntheticRaisesUtilisation) {
  for (const char* schedule : {"1f1b", "gpipe"}) {
    SimRun r = Sim(absl::StrCat("kfac --schedule ", schedule,
                                " --stages 8 --microbatches 8 --profile bert-large-bs32 --json"),
                   /*merge_stderr=*/false);
    ASSERT_EQ(r.code, 0) << r.out;
    google::protobuf::Struct report = ParseObject(r.out);
    const auto& f = report.fields();
    const double before = f.at("utilization_before").number_value();
    const double after = f.at("utilization_after").number_value();
    // (N)/(N+D-1) = 8/15 without K-FAC.
    EXPECT_NEAR(before, 8.0 / 15, 1e-6) << schedule;
    EXPECT_GT(after, before + 0.03) << schedule;
    EXPECT_GE(f.at("completed_refreshes").number_value(), 3);
    EXPECT_GE(f.at("mean_refresh_interval").number_value(), 1);
    EXPECT_GT(f.at("iterations").list_value().values_size(), 0);
  }
  // Text output and the SVG with K-FAC colours.
  const std::string svg = Temp("kfac.svg");
  SimRun t =
      Sim(absl::StrCat("kfac --schedule 1f1b --stages 4 --microbatches 4 --forward-ms 1 "
                       "--backward-ms 2 --curvature-ms 1 --inversion-ms 5 --blocks 8 "
                       "--svg ",
                       svg));
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_NE(t.out.find("mean refresh interval"), std::string::npos) << t.out;
  const std::string picture = Read(svg);
  EXPECT_EQ(picture.rfind("<svg", 0), 0u);
  EXPECT_NE(picture.find("inversion A"), std::string::npos);
  EXPECT_NE(picture.find("KIND_CURVATURE_A"), std::string::npos);
}

// Chimera: two pipelines in opposite directions over the same 8 devices.
// With N = D the iteration takes D forward and 2D-2 backward times
// (pipefisher.md §5): BERT-Large bs32 (16.10 / 26.95 ms per block, 3 blocks
// per stage) gives utilisation 8·43.05 / (8·16.10 + 14·26.95) = 68.05%.
// pipefisher.md states "≈ 68%" (rounded to a percent), hence the ±0.5
// point tolerance against it; the slot formula itself holds to rounding.
TEST(DetourSimCliTest, KfacChimera) {
  SimRun r =
      Sim("kfac --schedule chimera --stages 8 --microbatches 8 --profile bert-large-bs32 "
          "--no-sync --json",
          /*merge_stderr=*/false);
  ASSERT_EQ(r.code, 0) << r.out;
  google::protobuf::Struct report = ParseObject(r.out);
  const auto& f = report.fields();
  const double before = f.at("utilization_before").number_value();
  const double after = f.at("utilization_after").number_value();
  EXPECT_NEAR(before, 0.68, 0.005);
  EXPECT_NEAR(before, 8 * 43.05 / (8 * 16.10 + 14 * 26.95), 1e-6);
  EXPECT_NEAR(f.at("pipeline_time_s").number_value(), 3 * (8 * 16.10 + 14 * 26.95) / 1000, 1e-9);
  EXPECT_GT(after, before + 0.1);
  EXPECT_FALSE(f.at("sync_factors").bool_value());
  EXPECT_GE(f.at("completed_refreshes").number_value(), 3);
  EXPECT_NE(f.at("scenario").string_value().find("chimera"), std::string::npos);

  // D = N = 4, forward 1 ms, backward 2 ms, one block per stage: the
  // iteration takes 4·1 + 6·2 = 16 ms, each device computes 4·(1+2) = 12 ms.
  SimRun unit =
      Sim("kfac --schedule chimera --stages 4 --microbatches 4 --forward-ms 1 "
          "--backward-ms 2 --curvature-ms 1 --inversion-ms 5 --blocks 4 --json",
          /*merge_stderr=*/false);
  ASSERT_EQ(unit.code, 0) << unit.out;
  google::protobuf::Struct u = ParseObject(unit.out);
  EXPECT_NEAR(u.fields().at("pipeline_time_s").number_value(), 0.016, 1e-12);
  EXPECT_NEAR(u.fields().at("utilization_before").number_value(), 0.75, 1e-9);
  // Every stage has two replicas (one per direction): the scheme is chosen
  // as for a job (AUTO). A synthetic pipeline has no links, so the factor
  // all-reduce costs nothing and the exact scheme is taken.
  EXPECT_TRUE(u.fields().at("sync_factors").bool_value());
  EXPECT_EQ(u.fields().at("replica_sync").string_value(), "factors");
  const auto& choice = u.fields().at("replica_sync_choice").struct_value().fields();
  EXPECT_NEAR(choice.at("factors_iteration_s").number_value(),
              choice.at("preconditioned_iteration_s").number_value(), 1e-12);
  EXPECT_NE(choice.at("reason").string_value().find("K-FAC replica sync FACTORS"),
            std::string::npos);
  SimRun pre =
      Sim("kfac --schedule chimera --stages 4 --microbatches 4 --forward-ms 1 "
          "--backward-ms 2 --curvature-ms 1 --inversion-ms 5 --blocks 4 "
          "--replica-sync preconditioned --json",
          /*merge_stderr=*/false);
  ASSERT_EQ(pre.code, 0) << pre.out;
  google::protobuf::Struct p = ParseObject(pre.out);
  EXPECT_EQ(p.fields().at("replica_sync").string_value(), "preconditioned");
  EXPECT_EQ(p.fields().at("replica_sync_choice").kind_case(), google::protobuf::Value::kNullValue);
  SimRun factors =
      Sim("kfac --schedule chimera --stages 4 --microbatches 4 --forward-ms 1 "
          "--backward-ms 2 --curvature-ms 1 --inversion-ms 5 --blocks 4 "
          "--replica-sync factors --json",
          /*merge_stderr=*/false);
  ASSERT_EQ(factors.code, 0) << factors.out;
  google::protobuf::Struct fs = ParseObject(factors.out);
  EXPECT_TRUE(fs.fields().at("sync_factors").bool_value());
  EXPECT_EQ(fs.fields().at("replica_sync").string_value(), "factors");
}

// Granules (docs/KFAC.md): the K-FAC targets on the BERT-Large P100
// profile. 1F1B: no task placed in a gap is longer than 20 ms (whole items:
// a 4096-wide inversion, 40 ms). Chimera 8 x 8: >= 97.6% utilisation over
// 30 iterations (PipeFisher's figure; the default run of 3 refreshes
// includes the start-up iteration, see docs/BENCHMARKS.md).
TEST(DetourSimCliTest, KfacGranulesMeetTheTargets) {
  auto run = [](const std::string& args) {
    SimRun r = Sim(absl::StrCat("kfac --stages 8 --microbatches 8 --profile bert-large-bs32 ", args,
                                " --json"),
                   /*merge_stderr=*/false);
    EXPECT_EQ(r.code, 0) << r.out;
    return ParseObject(r.out);
  };
  const google::protobuf::Struct split = run("--schedule 1f1b");
  EXPECT_EQ(split.fields().at("max_granule_ms").number_value(), 5);
  EXPECT_LE(split.fields().at("longest_bubble_task_ms").number_value(), 20);
  EXPECT_GT(split.fields().at("longest_bubble_task_ms").number_value(), 0);
  const google::protobuf::Struct whole = run("--schedule 1f1b --max-granule-ms 0");
  EXPECT_GT(whole.fields().at("longest_bubble_task_ms").number_value(), 35);
  EXPECT_EQ(whole.fields().at("longest_bubble_task").string_value().find("part"),
            std::string::npos);
  // Replicas precondition their own gradients (no factor sync, as in
  // PipeFisher's Chimera).
  const google::protobuf::Struct chimera =
      run("--schedule chimera --iterations 30 --replica-sync preconditioned");
  EXPECT_GE(chimera.fields().at("utilization_after").number_value(), 0.976);
  // The default run (until 3 refreshes) includes the start-up iterations,
  // which no earlier refresh's inversions can fill; its steady state (the
  // iterations after the first activation) meets the target too.
  const google::protobuf::Struct chimera_default =
      run("--schedule chimera --replica-sync preconditioned");
  EXPECT_GE(chimera_default.fields().at("steady_iterations").number_value(), 1);
  EXPECT_GE(chimera_default.fields().at("utilization_after_steady").number_value(), 0.976);
  EXPECT_GT(chimera_default.fields().at("utilization_after_steady").number_value(),
            chimera_default.fields().at("utilization_after").number_value());
  // One iteration: nothing follows an activation.
  const google::protobuf::Struct one = run("--schedule chimera --iterations 1");
  EXPECT_EQ(one.fields().at("steady_iterations").number_value(), 0);
  EXPECT_EQ(one.fields().at("utilization_after_steady").kind_case(),
            google::protobuf::Value::kNullValue);
  const google::protobuf::Struct chimera_whole =
      run("--schedule chimera --iterations 30 --replica-sync preconditioned --max-granule-ms 0");
  EXPECT_LT(chimera_whole.fields().at("utilization_after").number_value(),
            chimera.fields().at("utilization_after").number_value());
}

TEST(DetourSimCliTest, KfacReplicaSyncOnThePlannedExample) {
  // geo20's stages have 3 replicas: the factor all-reduce is priced from the
  // links and lengthens the iteration; preconditioned replicas pay nothing.
  auto run = [](const std::string& sync) {
    SimRun r = Sim(absl::StrCat("kfac ", Example(), " --tflops 5 --replica-sync ", sync, " --json"),
                   /*merge_stderr=*/false);
    EXPECT_EQ(r.code, 0) << r.out;
    return ParseObject(r.out);
  };
  const google::protobuf::Struct factors = run("factors");
  const google::protobuf::Struct pre = run("preconditioned");
  const google::protobuf::Struct none = run("none");
  const double t_factors = factors.fields().at("time_overhead").number_value();
  const double t_pre = pre.fields().at("time_overhead").number_value();
  EXPECT_GT(t_factors, 0.1);
  EXPECT_LT(t_pre, 0.05);
  EXPECT_NEAR(t_pre, none.fields().at("time_overhead").number_value(), 1e-9);
  // The job default (AUTO) weighs the two: the factor all-reduce costs more
  // than the 5% the exact factors are worth, so replicas precondition.
  const google::protobuf::Struct chosen = run("auto");
  EXPECT_EQ(chosen.fields().at("replica_sync").string_value(), "preconditioned");
  EXPECT_NEAR(chosen.fields().at("time_overhead").number_value(), t_pre, 1e-9);
  const auto& why = chosen.fields().at("replica_sync_choice").struct_value().fields();
  EXPECT_GT(why.at("factors_iteration_s").number_value(),
            1.05 * why.at("preconditioned_iteration_s").number_value());
}

TEST(DetourSimCliTest, KfacOnThePlannedExample) {
  SimRun r = Sim(absl::StrCat("kfac ", Example(), " --no-sync --json"), /*merge_stderr=*/false);
  ASSERT_EQ(r.code, 0) << r.out;
  google::protobuf::Struct report = ParseObject(r.out);
  const auto& f = report.fields();
  EXPECT_GT(f.at("utilization_after").number_value(), f.at("utilization_before").number_value());
  EXPECT_FALSE(f.at("sync_factors").bool_value());
}

TEST(DetourSimCliTest, KfacUsageErrors) {
  struct Case {
    std::string args, expect;
  };
  for (const Case& c : std::vector<Case>{
           {"kfac --schedule zigzag --stages 2 --microbatches 2 --profile bert-base-bs8",
            "--schedule"},
           {"kfac --schedule chimera --stages 3 --microbatches 2 --profile bert-base-bs8",
            "even --stages and --microbatches"},
           {"kfac --schedule chimera --stages 2 --microbatches 3 --profile bert-base-bs8",
            "even --stages and --microbatches"},
           {"kfac --schedule 1f1b --stages 0 --microbatches 2 --profile bert-base-bs8", "--stages"},
           {"kfac --schedule 1f1b --microbatches 2 --profile bert-base-bs8", "--stages"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --profile gpt-huge", "--profile"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --forward-ms 1", "--backward-ms"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --profile bert-base-bs8 "
            "--forward-ms -1",
            "--forward-ms"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --profile bert-base-bs8 --slack x",
            "--slack"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --profile bert-base-bs8 --bogus",
            "--bogus"},
           {"kfac --stages 2", "--schedule"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --profile bert-base-bs8 "
            "--replica-sync sometimes",
            "--replica-sync: auto, preconditioned, factors or none"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --profile bert-base-bs8 "
            "--no-sync --replica-sync auto",
            "--replica-sync auto contradicts"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --profile bert-base-bs8 "
            "--replica-sync preconditioned --sync",
            "contradicts"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --profile bert-base-bs8 "
            "--max-granule-ms 0.001",
            "--max-granule-ms: needs 0 or a number in [0.01, 60000]"},
           {"kfac --schedule 1f1b --stages 2 --microbatches 2 --profile bert-base-bs8 "
            "--max-granule-ms -2",
            "--max-granule-ms"},
       }) {
    SimRun r = Sim(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
  SimRun unknown = Sim("kfac --schedule 1f1b --stages 2 --microbatches 2 --profile gpt-huge");
  EXPECT_NE(unknown.out.find("unknown profile"), std::string::npos) << unknown.out;
  SimRun typo =
      Sim("kfac --schedule 1f1b --stages 2 --microbatches 2 --profile bert-base-bs8 "
          "--slak 0.1");
  EXPECT_EQ(typo.code, 2);
  EXPECT_NE(typo.out.find("did you mean --slack?"), std::string::npos) << typo.out;
  SimRun help = Sim("kfac --help");
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("bert-large-bs32"), std::string::npos);
  EXPECT_NE(help.out.find("--refreshes (int, default 3)"), std::string::npos) << help.out;
}

}  // namespace
}  // namespace detour
