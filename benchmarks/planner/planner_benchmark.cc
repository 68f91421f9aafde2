// Planning time at 20 / 100 / 1000 nodes and simulator throughput.
//
//   build-sim/benchmarks/planner/planner_benchmark
//
// Clusters beyond the shipped 20-node example are synthetic: nodes dealt
// round-robin over the example's 11 AWS regions (same links), speeds drawn
// from [0.75, 1.25] with a fixed seed.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/sim/cost_model.h"
#include "common/sim/event_simulator.h"
#include "common/spec.h"
#include "coordinator/planner/baselines.h"
#include "coordinator/planner/planner.h"
#include "coordinator/planner/route_rules.h"
#include "coordinator/planner/stage_assignment.h"

namespace detour::planner {
namespace {

std::string SourceDir() {
  const char* dir = std::getenv("DETOUR_SOURCE_DIR");
  return dir ? dir : DETOUR_BENCH_SOURCE_DIR;
}

struct Setup {
  v1::ClusterSpec cluster;
  v1::JobSpec job;
};

// nodes = data + (stages-1)·replicas (+ spare); the 20-node case is the
// shipped example itself.
Setup MakeSetup(int nodes, int stages, int data, int replicas, int microbatches) {
  Setup s;
  auto example = LoadClusterSpec(SourceDir() + "/examples/clusters/geo20.json");
  auto job = LoadJobSpec(SourceDir() + "/examples/jobs/geo20_1.5b.json");
  if (!example.ok() || !job.ok()) std::abort();
  s.job = *job;
  if (nodes == 20) {
    s.cluster = *example;
  } else {
    std::vector<std::string> regions;
    for (const auto& n : example->nodes()) {
      if (std::find(regions.begin(), regions.end(), n.region()) == regions.end()) {
        regions.push_back(n.region());
      }
    }
    s.cluster = *example;
    s.cluster.clear_nodes();
    s.cluster.set_name(absl::StrCat("synthetic", nodes));
    Rng rng(42);
    for (int i = 0; i < nodes; ++i) {
      auto* n = s.cluster.add_nodes();
      n->set_id(absl::StrCat("n", i));
      n->set_region(regions[i % regions.size()]);
      n->set_speed(0.75 + 0.5 * rng.UniformReal());
    }
  }
  auto* p = s.job.mutable_pipeline();
  p->set_num_stages(stages);
  p->set_data_nodes(data);
  p->set_replicas_per_stage(replicas);
  p->set_microbatches_per_data_node(microbatches);
  if (stages > 24) {
    s.job.mutable_model()->set_preset("");
    s.job.mutable_model()->set_num_layers(stages);  // 8b shape, one block per stage
    s.job.mutable_model()->set_d_model(4096);
    s.job.mutable_model()->set_num_heads(32);
    s.job.mutable_model()->set_num_kv_heads(8);
    s.job.mutable_model()->set_ffn_dim(14336);
    s.job.mutable_model()->set_context_length(4096);
    s.job.mutable_model()->set_vocab_size(128256);
  }
  return s;
}

void PlanBenchmark(benchmark::State& state, int nodes, int stages, int data, int replicas,
                   int microbatches, v1::SchedulerKind kind) {
  Setup s = MakeSetup(nodes, stages, data, replicas, microbatches);
  auto job = NormalizeJobSpec(s.job);
  if (!job.ok()) {
    state.SkipWithError(std::string(job.status().message()).c_str());
    return;
  }
  auto cost = sim::CostModel::Create(s.cluster, *job);
  if (!cost.ok()) {
    state.SkipWithError(std::string(cost.status().message()).c_str());
    return;
  }
  PlannerOptions o;
  o.scheduler = kind;
  o.seed = 1;
  o.sim.record_timeline = false;
  double ratio = 0, evaluations = 0, pipeline = 0;
  for (auto _ : state) {
    auto it = PlanIteration(*cost, *job, o);
    if (!it.ok()) {
      state.SkipWithError(std::string(it.status().message()).c_str());
      return;
    }
    pipeline = it->result.pipeline_time_s;
    evaluations = it->search.evaluations;
    if (kind == v1::SCHEDULER_SKIPPIPE) {
      PlannerOptions full = o;
      full.scheduler = v1::SCHEDULER_FULL;
      full.assignment = it->plan.assignment;
      state.PauseTiming();
      auto f = PlanIteration(*cost, *job, full);
      state.ResumeTiming();
      if (f.ok()) ratio = pipeline / f->result.pipeline_time_s;
    }
  }
  state.counters["microbatches"] = data * microbatches;
  state.counters["pipeline_s"] = pipeline;
  state.counters["vs_full"] = ratio;
  state.counters["evaluations"] = evaluations;
}

void BM_Plan20(benchmark::State& state) {
  PlanBenchmark(state, 20, 6, 5, 3, 6, static_cast<v1::SchedulerKind>(state.range(0)));
}
BENCHMARK(BM_Plan20)
    ->Arg(v1::SCHEDULER_SKIPPIPE)
    ->Arg(v1::SCHEDULER_SKIP_NO_COLLISION)
    ->Arg(v1::SCHEDULER_RANDOM)
    ->Arg(v1::SCHEDULER_FULL)
    ->Unit(benchmark::kMillisecond);

// 100 nodes, 10 stages: 10 data nodes, 10 replicas; microbatches per data
// node varied (total = 10×).
void BM_Plan100(benchmark::State& state) {
  PlanBenchmark(state, 100, 10, 10, 10, static_cast<int>(state.range(0)), v1::SCHEDULER_SKIPPIPE);
}
BENCHMARK(BM_Plan100)
    ->Arg(3)
    ->Arg(6)
    ->Arg(12)
    ->Arg(24)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

// Nodes varied at 10 stages, 6 microbatches per data node.
void BM_PlanNodes(benchmark::State& state) {
  const int nodes = static_cast<int>(state.range(0));
  const int replicas = nodes / 10;
  PlanBenchmark(state, nodes, 10, nodes - 9 * replicas, replicas, 6, v1::SCHEDULER_SKIPPIPE);
}
BENCHMARK(BM_PlanNodes)
    ->Arg(50)
    ->Arg(100)
    ->Arg(200)
    ->Arg(400)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

// 1000 nodes, 32 stages, 40 data nodes × 25 = 1000 microbatches.
void BM_Plan1000(benchmark::State& state) {
  PlanBenchmark(state, 1000, 32, 40, 30, 25, static_cast<v1::SchedulerKind>(state.range(0)));
}
BENCHMARK(BM_Plan1000)
    ->Arg(v1::SCHEDULER_SKIPPIPE)
    ->Arg(v1::SCHEDULER_SKIP_NO_COLLISION)
    ->Unit(benchmark::kSecond)
    ->Iterations(1);

// Simulator throughput on a 1000-node plan (skip-no-collision routes).
void BM_Simulate1000(benchmark::State& state) {
  Setup s = MakeSetup(1000, 32, 40, 30, 25);
  auto job = NormalizeJobSpec(s.job);
  auto cost = sim::CostModel::Create(s.cluster, *job);
  if (!job.ok() || !cost.ok()) {
    state.SkipWithError("setup failed");
    return;
  }
  PlannerOptions o;
  o.scheduler = v1::SCHEDULER_SKIP_NO_COLLISION;
  o.sim.record_timeline = false;
  auto it = PlanIteration(*cost, *job, o);
  if (!it.ok()) {
    state.SkipWithError(std::string(it.status().message()).c_str());
    return;
  }
  sim::SimOptions so;
  so.record_timeline = state.range(0) != 0;
  int64_t events = 0;
  for (auto _ : state) {
    auto r = sim::Simulate(*cost, it->plan, so);
    benchmark::DoNotOptimize(r);
    events += r->events;
  }
  state.counters["events_per_s"] = benchmark::Counter(events, benchmark::Counter::kIsRate);
  state.counters["events"] = static_cast<double>(events) / state.iterations();
}
BENCHMARK(BM_Simulate1000)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// Simulator throughput on the 20-node example (the planner's inner loop).
void BM_Simulate20(benchmark::State& state) {
  Setup s = MakeSetup(20, 6, 5, 3, 6);
  auto cost = sim::CostModel::Create(s.cluster, s.job);
  PlannerOptions o;
  o.scheduler = v1::SCHEDULER_SKIP_NO_COLLISION;
  auto it = PlanIteration(*cost, s.job, o);
  if (!it.ok()) {
    state.SkipWithError("setup failed");
    return;
  }
  sim::SimOptions so;
  so.record_timeline = false;
  int64_t events = 0;
  for (auto _ : state) {
    auto r = sim::Simulate(*cost, it->plan, so);
    benchmark::DoNotOptimize(r);
    events += r->events;
  }
  state.counters["events_per_s"] = benchmark::Counter(events, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Simulate20)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace detour::planner

BENCHMARK_MAIN();
