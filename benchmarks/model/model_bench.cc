// Model-core benchmarks (results in docs/BENCHMARKS.md, "Model core").
//
// BM_SplitOverhead/<preset>: forward+backward tokens/s through the stage
//   split (PipelineEngine, 4 stages, full routes) and through one plain
//   Transformer module of the same shape and seed, interleaved round by round
//   in the same process; reports both rates (medians, in tokens per CPU
//   second, one intra-op thread) and the split's overhead. The machines are
//   shared and noisy, so the ratio is what counts.
// BM_Recompute/<preset>, BM_Precision/<preset>: a slot's heap bytes and the
//   forward+backward time with activation recomputation / in bf16 against the
//   plain float32 stage, paired round by round.
// BM_SlotMemory/<preset>: heap bytes one in-flight microbatch holds in a
//   stage between Forward and Backward, per transformer block and sample,
//   measured with mallinfo2 at two reduced context lengths and, where it
//   fits in memory, at the preset's full context; the full-context value is
//   extrapolated with m(T) = a·T + b·T² (attention scores grow with T²).
// BM_OrderedAccumulation/<preset>: gradients summed in microbatch order
//   (kept apart, then folded) against summed as the backwards run, with the
//   backwards in reverse order; CPU time paired round by round, and what
//   the kept gradients hold at their peak.
// BM_ParameterChecksum/<preset>: the parameter checksum a worker sends after
//   every step (worker/runtime/job_runtime.cc), as a fraction of the step's
//   forward+backward over the same parameters (4 stages, full routes): the
//   byte-wise FNV-1a over a CPU copy it replaced and the runtime's own
//   ParameterChecksum (worker/runtime/stage_state.h), paired round by round.
// BM_FrameCheck/<preset>: the finite-value check a receiver makes on every
//   activation and activation gradient it takes (CheckFrameValues,
//   worker/runtime/runtime_part.h), as a fraction of the step's
//   forward+backward (4 stages, full routes): per step, each microbatch
//   crosses 3 stage boundaries each way, so the step pays 6 checks per
//   microbatch, each on a tensor of its own (as a received frame is, not yet
//   in cache); paired round by round.
#include <chrono>
#include <malloc.h>

#include <algorithm>
#include <ctime>
#include <memory>
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "common/spec.h"
#include "common/status.h"
#include "worker/model/engine.h"
#include "worker/model/routes.h"
#include "worker/model/transformer.h"
#include "worker/runtime/runtime_part.h"
#include "worker/runtime/stage_state.h"

namespace detour::model {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Process CPU time: with one intra-op thread it is the compute itself, and
// unlike wall time it does not grow when other builds share the cores.
double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int64_t HeapInUse() {
  struct mallinfo2 mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

// The median of a[i] / b[i], round by round: less sensitive to slow drifts
// in machine load than the ratio of the medians.
double MedianRatio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> ratios;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) ratios.push_back(a[i] / b[i]);
  return Median(ratios);
}

// Runs each of `steps` once, in the order given on even rounds and in
// reverse on odd ones, so that drifts in machine load hit every side; the
// times the steps return, in the order given.
std::vector<double> Interleaved(int round, const std::vector<std::function<double()>>& steps) {
  std::vector<double> times(steps.size());
  for (size_t k = 0; k < steps.size(); ++k) {
    const size_t i = round % 2 == 0 ? k : steps.size() - 1 - k;
    times[i] = steps[i]();
  }
  return times;
}

// The model config of `preset`, with one intra-op thread; nullopt after
// marking `state` skipped.
std::optional<ModelConfig> PresetConfig(benchmark::State& state, const std::string& preset) {
  at::set_num_threads(1);
  v1::ModelShape shape;
  shape.set_preset(preset);
  auto config = ModelConfigFromShape(shape);
  if (!config.ok()) {
    state.SkipWithError("bad preset");
    return std::nullopt;
  }
  return *config;
}

// Stage 1 of 2 of a four-block `config`: two blocks, no embedding or head.
ModelConfig TwoBlockConfig(ModelConfig config) {
  config.num_layers = 4;
  return config;
}

// Heap bytes one microbatch `x` holds in `stage` between Forward and
// Backward, after a warm-up Forward and Backward (with gradient `g`) so
// that one-time allocations are not counted; -1 on failure.
double SlotBytes(Stage& stage, const at::Tensor& x, const at::Tensor& g) {
  if (!stage.Forward(0, x).ok() || !stage.Backward(0, g).ok()) return -1;
  const int64_t before = HeapInUse();
  auto out = stage.Forward(1, x);
  const int64_t after = HeapInUse();
  stage.DropAll();
  return out.ok() ? static_cast<double>(after - before) : -1;
}

// Wall seconds of one Forward and Backward of `x` in `stage`; -1 on failure.
double ForwardBackwardSeconds(Stage& stage, const at::Tensor& x, const at::Tensor& g) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!stage.Forward(2, x).ok() || !stage.Backward(2, g).ok()) return -1.0;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The engine of `preset` in 4 stages, full routes, with `microbatches`
// random microbatches of `samples` samples: what the split and checksum
// benchmarks step.
struct FullRoutes {
  v1::JobSpec spec;
  std::unique_ptr<PipelineEngine> engine;
  ModelConfig config;
  std::vector<Microbatch> mbs;
  std::vector<v1::Route> routes;

  // Forward and backward of every microbatch through every stage.
  void Step() {
    auto loss = engine->Accumulate(routes, mbs);
    if (!loss.ok()) std::abort();
    for (int s = 0; s < 4; ++s) engine->stage(s).ZeroGrad();
  }
};

absl::StatusOr<FullRoutes> MakeFullRoutes(const std::string& preset, int samples,
                                          int microbatches) {
  FullRoutes f;
  f.spec.set_name("bench");
  f.spec.set_iterations(1);
  f.spec.mutable_model()->set_preset(preset);
  f.spec.mutable_pipeline()->set_num_stages(4);
  f.spec.mutable_pipeline()->set_samples_per_microbatch(samples);
  f.spec.mutable_pipeline()->set_microbatches_per_data_node(microbatches);
  ApplyJobDefaults(&f.spec);
  ASSIGN_OR_RETURN(f.engine, PipelineEngine::Create(f.spec, at::Device(at::kCPU)));
  ASSIGN_OR_RETURN(f.config, ModelConfigFromShape(f.spec.model()));
  const int ctx = f.config.context_length;
  for (int m = 0; m < microbatches; ++m) {
    at::Tensor t = at::randint(0, f.config.vocab_size, {samples, ctx + 1}, at::kLong);
    f.mbs.push_back({t.narrow(1, 0, ctx).contiguous(), t.narrow(1, 1, ctx).contiguous()});
  }
  for (int m = 0; m < microbatches; ++m) f.routes.push_back(MakeRoute(m, {0, 1, 2, 3}));
  return f;
}

// MakeFullRoutes with one intra-op thread; nullopt after marking `state`
// skipped.
std::optional<FullRoutes> FullRoutesOrSkip(benchmark::State& state, const std::string& preset,
                                           int samples, int microbatches) {
  at::set_num_threads(1);
  auto setup = MakeFullRoutes(preset, samples, microbatches);
  if (!setup.ok()) {
    state.SkipWithError("cannot build the model");
    return std::nullopt;
  }
  return std::move(*setup);
}

void BM_SplitOverhead(benchmark::State& state, const std::string& preset, int samples,
                      int microbatches) {
  auto setup = FullRoutesOrSkip(state, preset, samples, microbatches);
  if (!setup) return;
  const v1::JobSpec& spec = setup->spec;
  Transformer plain(setup->config, spec.seed(), at::Device(at::kCPU));
  const int ctx = setup->config.context_length;
  const std::vector<Microbatch>& mbs = setup->mbs;
  auto run_plain = [&] {
    for (const auto& mb : mbs) {
      at::Tensor loss = plain->Loss(mb.tokens, mb.targets);
      torch::autograd::backward({loss});
    }
    for (auto& [n, p] : plain->GlobalParameters()) p.mutable_grad() = at::Tensor();
  };
  auto run_split = [&] { setup->Step(); };
  run_plain();  // warm-up both
  run_split();
  auto timed = [](const std::function<void()>& run) {
    return [run] {
      const double a = CpuSeconds();
      run();
      return CpuSeconds() - a;
    };
  };
  std::vector<double> t_plain, t_split;
  int round = 0;
  for (auto _ : state) {
    const std::vector<double> t = Interleaved(round++, {timed(run_plain), timed(run_split)});
    t_plain.push_back(t[0]);
    t_split.push_back(t[1]);
  }
  const double tokens = static_cast<double>(microbatches) * samples * ctx;
  state.counters["plain_tok_per_s"] = tokens / Median(t_plain);
  state.counters["split_tok_per_s"] = tokens / Median(t_split);
  state.counters["split_overhead_pct"] = 100.0 * (Median(t_split) / Median(t_plain) - 1.0);
  state.counters["split_overhead_pct_paired"] = 100.0 * (MedianRatio(t_split, t_plain) - 1.0);
}

// The checksum the runtime used before FastHash64: FNV-1a one byte at a time
// over a CPU copy of every parameter. Kept here as the baseline.
uint64_t ByteFnvOverCopies(const std::vector<NamedTensor>& params) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& [name, t] : params) {
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0, n = c.nbytes(); i < n; ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  }
  return h;
}

void BM_ParameterChecksum(benchmark::State& state, const std::string& preset, int samples,
                          int microbatches) {
  auto setup = FullRoutesOrSkip(state, preset, samples, microbatches);
  if (!setup) return;
  std::vector<NamedTensor> params;
  for (int s = 0; s < 4; ++s) {
    for (const NamedTensor& p : setup->engine->stage(s).Parameters()) params.push_back(p);
  }
  double bytes = 0;
  for (const auto& [n, t] : params) bytes += static_cast<double>(t.nbytes());
  setup->Step();  // warm-up
  std::vector<double> t_step, t_old, t_new;
  uint64_t sink = 0;
  for (auto _ : state) {
    double a = CpuSeconds();
    setup->Step();
    t_step.push_back(CpuSeconds() - a);
    a = CpuSeconds();
    sink ^= ByteFnvOverCopies(params);
    t_old.push_back(CpuSeconds() - a);
    a = CpuSeconds();
    sink ^= ParameterChecksum(params);
    t_new.push_back(CpuSeconds() - a);
  }
  benchmark::DoNotOptimize(sink);
  state.counters["param_mib"] = bytes / (1 << 20);
  state.counters["step_s"] = Median(t_step);
  state.counters["old_ms"] = 1e3 * Median(t_old);
  state.counters["new_ms"] = 1e3 * Median(t_new);
  state.counters["old_pct_of_step"] = 100.0 * MedianRatio(t_old, t_step);
  state.counters["new_pct_of_step"] = 100.0 * MedianRatio(t_new, t_step);
  state.counters["new_gb_per_s"] = bytes / Median(t_new) / 1e9;
}

void BM_FrameCheck(benchmark::State& state, const std::string& preset, int samples,
                   int microbatches) {
  auto setup = FullRoutesOrSkip(state, preset, samples, microbatches);
  if (!setup) return;
  // One activation-shaped tensor per check of a step: 3 boundaries each
  // way per microbatch.
  const int checks = 6 * microbatches;
  std::vector<at::Tensor> frames;
  for (int i = 0; i < checks; ++i) {
    frames.push_back(at::randn({samples, setup->config.context_length, setup->config.d_model}));
  }
  setup->Step();  // warm-up
  std::vector<double> t_step, t_check;
  for (auto _ : state) {
    double a = CpuSeconds();
    setup->Step();
    t_step.push_back(CpuSeconds() - a);
    a = CpuSeconds();
    for (const at::Tensor& f : frames) {
      if (!CheckFrameValues(f).ok()) std::abort();
    }
    t_check.push_back(CpuSeconds() - a);
  }
  const double frame_bytes = static_cast<double>(frames.front().nbytes());
  state.counters["frame_mib"] = frame_bytes / (1 << 20);
  state.counters["checks_per_step"] = checks;
  state.counters["step_s"] = Median(t_step);
  state.counters["check_ms"] = 1e3 * Median(t_check) / checks;
  state.counters["checks_pct_of_step"] = 100.0 * MedianRatio(t_check, t_step);
  state.counters["check_gb_per_s"] = frame_bytes * checks / Median(t_check) / 1e9;
}

// Bytes held by one microbatch of one sample at context length `t` in
// `stage` (a one-block stage built for the longest `t` measured).
double SlotBytes(Stage& stage, int t) {
  const int d = stage.config().d_model;
  const at::Tensor x = at::randn({1, t, d});
  const at::Tensor g = at::randn({1, t, d});
  return SlotBytes(stage, x, g);
}

void BM_SlotMemory(benchmark::State& state, const std::string& preset, bool measure_full) {
  const std::optional<ModelConfig> config = PresetConfig(state, preset);
  if (!config) return;
  const int t_full = config->context_length;
  const int t1 = std::min(256, t_full / 2), t2 = 2 * t1;
  // Stage 1 of 2 of a two-block model: one block, no embedding or head.
  ModelConfig one = *config;
  one.num_layers = 2;
  one.context_length = measure_full ? t_full : t2;
  StageOptions options;
  options.memory_slots = 2;
  auto stage = Stage::Create(one, 1, 2, options);
  if (!stage.ok()) {
    state.SkipWithError("cannot build the stage");
    return;
  }
  double m1 = 0, m2 = 0, full = -1;
  for (auto _ : state) {
    m1 = SlotBytes(**stage, t1);
    m2 = SlotBytes(**stage, t2);
    if (measure_full) full = SlotBytes(**stage, t_full);
  }
  // m(T) = a·T + b·T² through (t1, m1), (t2, m2).
  const double b = (m2 / t2 - m1 / t1) / (t2 - t1);
  const double a = m1 / t1 - b * t1;
  const double extrapolated = a * t_full + b * t_full * static_cast<double>(t_full);
  state.counters["MiB_per_layer_sample"] = (full > 0 ? full : extrapolated) / (1 << 20);
  state.counters["MiB_extrapolated"] = extrapolated / (1 << 20);
  if (full > 0) state.counters["MiB_measured_full_ctx"] = full / (1 << 20);
  state.counters["context"] = t_full;
  state.counters["layers"] = config->num_layers;
}

// Activation recomputation against keeping the graph, same stage shape and
// seed, in one process: heap bytes one microbatch holds between Forward and
// Backward, and the time of Forward + Backward, interleaved round by round.
void BM_Recompute(benchmark::State& state, const std::string& preset, int samples) {
  const std::optional<ModelConfig> config = PresetConfig(state, preset);
  if (!config) return;
  const ModelConfig cfg = TwoBlockConfig(*config);
  StageOptions keep, again;
  keep.memory_slots = again.memory_slots = 2;
  again.recompute_activations = true;
  auto plain = Stage::Create(cfg, 1, 2, keep);
  auto recompute = Stage::Create(cfg, 1, 2, again);
  if (!plain.ok() || !recompute.ok()) {
    state.SkipWithError("cannot build the stages");
    return;
  }
  const int t = cfg.context_length;
  at::Tensor x = at::randn({samples, t, cfg.d_model});
  at::Tensor g = at::randn({samples, t, cfg.d_model});
  std::vector<double> t_plain, t_again;
  double m_plain = 0, m_again = 0;
  int round = 0;
  for (auto _ : state) {
    m_plain = SlotBytes(**plain, x, g);
    m_again = SlotBytes(**recompute, x, g);
    const std::vector<double> t =
        Interleaved(round++, {[&] { return ForwardBackwardSeconds(**plain, x, g); },
                              [&] { return ForwardBackwardSeconds(**recompute, x, g); }});
    t_plain.push_back(t[0]);
    t_again.push_back(t[1]);
  }
  state.counters["slot_MiB_keep"] = m_plain / (1 << 20);
  state.counters["slot_MiB_recompute"] = m_again / (1 << 20);
  state.counters["memory_ratio"] = m_again / m_plain;
  state.counters["fwd_bwd_s_keep"] = Median(t_plain);
  state.counters["fwd_bwd_s_recompute"] = Median(t_again);
  state.counters["time_ratio_paired"] = MedianRatio(t_again, t_plain);
}

// Ordered gradient accumulation (Stage::SetOrderedAccumulation, on in every
// worker) against summing as the backwards run, same stage shape and seed:
// `microbatches` forwards, then their backwards in reverse order (the worst
// case: every gradient is kept apart until the last, microbatch 0, comes)
// and the fold, timed in CPU seconds, paired round by round; and the most
// the kept gradients hold, against the stage's parameters.
void BM_OrderedAccumulation(benchmark::State& state, const std::string& preset, int samples,
                            int microbatches) {
  const std::optional<ModelConfig> config = PresetConfig(state, preset);
  if (!config) return;
  const ModelConfig cfg = TwoBlockConfig(*config);
  StageOptions options;
  options.memory_slots = microbatches;
  auto plain = Stage::Create(cfg, 1, 2, options);
  auto ordered = Stage::Create(cfg, 1, 2, options);
  if (!plain.ok() || !ordered.ok()) {
    state.SkipWithError("cannot build the stages");
    return;
  }
  (*ordered)->SetOrderedAccumulation(true);
  double param_bytes = 0;
  for (const auto& [name, p] : (*plain)->Parameters()) param_bytes += 4.0 * p.numel();
  const int t = cfg.context_length;
  at::Tensor x = at::randn({samples, t, cfg.d_model});
  at::Tensor g = at::randn({samples, t, cfg.d_model});
  double kept_peak = 0;
  auto step = [&](Stage& st) {
    const double t0 = CpuSeconds();
    for (int mb = 0; mb < microbatches; ++mb) {
      if (!st.Forward(static_cast<uint32_t>(mb), x).ok()) return -1.0;
    }
    for (int mb = microbatches - 1; mb >= 0; --mb) {
      if (!st.Backward(static_cast<uint32_t>(mb), g).ok()) return -1.0;
    }
    // Each kept microbatch holds a gradient of every parameter.
    kept_peak = std::max(kept_peak, static_cast<double>(st.kept_gradients()) * param_bytes);
    if (!st.FoldGradients().ok()) return -1.0;
    const double seconds = CpuSeconds() - t0;
    st.ZeroGrad();
    return seconds;
  };
  std::vector<double> t_plain, t_ordered;
  int round = 0;
  for (auto _ : state) {
    const std::vector<double> t =
        Interleaved(round++, {[&] { return step(**plain); }, [&] { return step(**ordered); }});
    t_plain.push_back(t[0]);
    t_ordered.push_back(t[1]);
  }
  state.counters["step_cpu_s_plain"] = Median(t_plain);
  state.counters["step_cpu_s_ordered"] = Median(t_ordered);
  state.counters["time_ratio_paired"] = MedianRatio(t_ordered, t_plain);
  state.counters["kept_MiB_peak"] = kept_peak / (1 << 20);
  state.counters["param_MiB"] = param_bytes / (1 << 20);
}

// bf16 mixed precision against float32, same stage shape and seed, in one
// process: heap bytes one microbatch holds between Forward and Backward (the
// bf16 weight copies are made before, shared by all microbatches until the
// next step, and reported apart), and the time of Forward + Backward,
// interleaved round by round. Also bf16 with activation recomputation.
void BM_Precision(benchmark::State& state, const std::string& preset, int samples) {
  const std::optional<ModelConfig> config = PresetConfig(state, preset);
  if (!config) return;
  const ModelConfig cfg = TwoBlockConfig(*config);
  StageOptions fp32, bf16, bf16_again;
  fp32.memory_slots = bf16.memory_slots = bf16_again.memory_slots = 2;
  bf16.compute_dtype = bf16_again.compute_dtype = at::kBFloat16;
  bf16_again.recompute_activations = true;
  auto full = Stage::Create(cfg, 1, 2, fp32);
  auto half = Stage::Create(cfg, 1, 2, bf16);
  auto half_again = Stage::Create(cfg, 1, 2, bf16_again);
  if (!full.ok() || !half.ok() || !half_again.ok()) {
    state.SkipWithError("cannot build the stages");
    return;
  }
  const int t = cfg.context_length;
  at::Tensor x = at::randn({samples, t, cfg.d_model});
  at::Tensor g = at::randn({samples, t, cfg.d_model});
  // The bf16 copies of the weights appear at the first forward after a
  // parameter change; measured on a fresh stage.
  double cast_bytes = 0;
  {
    auto fresh = Stage::Create(cfg, 1, 2, bf16);
    if (fresh.ok()) {
      const int64_t before = HeapInUse();
      if ((*fresh)->Forward(0, x).ok()) {
        (*fresh)->DropAll();
        // What stays after the slot is gone: the copies.
        cast_bytes = static_cast<double>(HeapInUse() - before);
      }
    }
  }
  std::vector<double> t_full, t_half, t_again;
  double m_full = 0, m_half = 0, m_again = 0;
  int round = 0;
  for (auto _ : state) {
    m_full = SlotBytes(**full, x, g);
    m_half = SlotBytes(**half, x, g);
    m_again = SlotBytes(**half_again, x, g);
    const std::vector<double> t =
        Interleaved(round++, {[&] { return ForwardBackwardSeconds(**full, x, g); },
                              [&] { return ForwardBackwardSeconds(**half, x, g); },
                              [&] { return ForwardBackwardSeconds(**half_again, x, g); }});
    t_full.push_back(t[0]);
    t_half.push_back(t[1]);
    t_again.push_back(t[2]);
  }
  state.counters["slot_MiB_fp32"] = m_full / (1 << 20);
  state.counters["slot_MiB_bf16"] = m_half / (1 << 20);
  state.counters["slot_MiB_bf16_recompute"] = m_again / (1 << 20);
  state.counters["memory_ratio_bf16"] = m_half / m_full;
  state.counters["bf16_weight_copies_MiB"] = cast_bytes / (1 << 20);
  state.counters["fwd_bwd_s_fp32"] = Median(t_full);
  state.counters["fwd_bwd_s_bf16"] = Median(t_half);
  state.counters["time_ratio_bf16_paired"] = MedianRatio(t_half, t_full);
  state.counters["time_ratio_bf16_recompute_paired"] = MedianRatio(t_again, t_full);
}

BENCHMARK_CAPTURE(BM_SplitOverhead, tiny, "tiny", 2, 4)->Iterations(7)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_SplitOverhead, small, "small", 1, 2)->Iterations(3)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_ParameterChecksum, tiny, "tiny", 2, 4)
    ->Iterations(7)
    ->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_ParameterChecksum, small, "small", 1, 2)
    ->Iterations(5)
    ->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_FrameCheck, tiny, "tiny", 2, 4)->Iterations(7)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_FrameCheck, small, "small", 1, 2)->Iterations(5)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_Recompute, tiny, "tiny", 4)->Iterations(9)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_Recompute, small, "small", 2)->Iterations(5)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_OrderedAccumulation, tiny, "tiny", 2, 8)
    ->Iterations(9)
    ->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_OrderedAccumulation, small, "small", 1, 8)
    ->Iterations(5)
    ->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_Precision, tiny, "tiny", 4)->Iterations(9)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_Precision, small, "small", 2)->Iterations(5)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_SlotMemory, tiny, "tiny", true)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_SlotMemory, small, "small", true)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_SlotMemory, 500m, "500m", true)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_SlotMemory, 1_5b, "1.5b", false)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_SlotMemory, 8b, "8b", false)->Iterations(1)->Unit(benchmark::kSecond);

}  // namespace
}  // namespace detour::model

BENCHMARK_MAIN();
