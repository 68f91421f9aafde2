// detour-train: trains the model in one process through the pipeline engine
// with full, skipping and reordering routes, and reports loss curves and the
// perplexity with all layers vs half of them. See --help and docs/MODEL.md.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <map>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plot.h"
#include "common/spec.h"
#include "common/status.h"
#include "common/version.h"
#include "worker/model/checkpoint.h"
#include "worker/model/engine.h"
#include "worker/model/evaluate.h"
#include "worker/model/routes.h"

namespace detour::train_tool {
namespace {

namespace fs = std::filesystem;
using model::PipelineEngine;

constexpr char kUsage[] =
    R"(detour-train: in-process convergence experiments for detour's model core.

Usage:
  detour-train [--job J.json] [--preset tiny] [--iterations N] [--runs SPEC]
               [--out DIR] [options]

Each run trains the same model from the same seed with its own routes and
writes, under --out: loss.csv (every iteration: losses, lr, gradient norm,
seconds since the start with and without validation), loss.svg (the curves),
results.md and results.csv (perplexity with all layers and with half of them,
every run's final weights evaluated in float32), ckpt-<run>/ (final checkpoint).
Validation during training runs in each run's own precision.

Options:
  --job FILE          JobSpec JSON (model, optimiser, data, seed, microbatches)
  --preset NAME       model preset when no --job (default tiny)
  --iterations N      training iterations per run (default 300)
  --runs SPEC         comma-separated NAME:STAGES:SKIP:SWAPS[:OPTIMIZER][:PRECISION]
                      ("" for none), e.g. full:4:0:0,skip25:4:0.25:0,
                      adamw:4:0:0:adamw,kfac:4:0:0:kfac or
                      fp32:4:0:0:adamw:fp32,bf16:4:0:0:adamw:bf16 (default: full:4:0:0,
                      skip25:4:0.25:0, skip25-swap:4:0.25:1, skip33:6:0.3333:0,
                      skip33-swap:6:0.3333:1)
  --plan NAME:FILE    add a run that reuses the routes of FILE every iteration:
                      what `detour-sim plan --json` writes (or an
                      IterationPlan / route array in JSON); stages = the
                      job's num_stages (--job) or the highest stage + 1
  --microbatches M    microbatches per iteration (default: the job's, 4)
  --samples B         samples per microbatch (default: the job's, else 2)
  --lr X              peak learning rate (default: the job's, else 3e-3)
  --warmup N          warm-up iterations (default: the job's, else 20)
  --seed N            seed (default: the job's)
  --eval-every K      validation loss every K iterations (default 50)
  --eval-samples N    validation samples per evaluation (default 64; the final
                      table uses 4x as many)
  --optimizer O       adamw or kfac: the runs' optimiser unless a run names its
                      own (default: the job's, else adamw)
  --kfac-lr X         K-FAC lr at the peak of the schedule (default: the AdamW lr)
  --kfac-damping X    K-FAC damping λ (default: the job's, else 1e-3)
  --kfac-refresh N    refresh the K-FAC inverses every N iterations (default:
                      the job's refresh_interval; 0 = every 10)
  --kfac-momentum X   momentum of the K-FAC update (default 0.9)
  --kfac-kl-clip X    KL clip of the K-FAC update, negative = off (default 1e-3)
  --kfac-curvature N  curvature microbatches per data node and refresh (default 1)
  --kfac-update U     graft (K-FAC direction, AdamW's per-projection step
                      length; default) or momentum (momentum SGD, KL clip)
  --kfac-factor-decay X  running-average weight of new factors, (0, 1]
                      (default: the job's, else 1)
  --precision P       fp32 or bf16 (mixed precision, pipeline.precision): the
                      runs' compute precision unless a run names its own
                      (default: the job's, else fp32)
  --threads N         intra-op threads (default 1; more only on idle cores)
  --device D          cpu (default) or cuda (needs a CUDA build of LibTorch)
  --out DIR           output directory (default detour-train-out)
Flags may be spelled with '_' instead of '-' (--kfac_damping), and take
`--name value` or `--name=value`; --version prints the version.
Exit status: 0 on success, 1 on a failed run, 2 on bad usage.
)";

struct Run {
  std::string name;
  int stages = 4;
  double skip = 0;
  int swaps = 0;
  std::string optimizer;                // "" = --optimizer / the job's
  std::string precision;                // "" = --precision / the job's
  std::vector<v1::Route> fixed_routes;  // --plan: used every iteration
};

struct Args {
  std::string job, preset = "tiny", out = "detour-train-out", device = "cpu";
  std::vector<std::string> plans;
  std::string runs =
      "full:4:0:0,skip25:4:0.25:0,skip25-swap:4:0.25:1,"
      "skip33:6:0.3333:0,skip33-swap:6:0.3333:1";
  int64_t iterations = 300, microbatches = 0, samples = 0, warmup = -1;
  int64_t eval_every = 50, eval_samples = 64, threads = 1;
  double lr = 0;
  std::string optimizer, precision;
  double kfac_lr = 0, kfac_damping = 0, kfac_momentum = -1, kfac_kl_clip = 0;
  int64_t kfac_refresh = -1, kfac_curvature = 0;
  std::string kfac_update;
  double kfac_factor_decay = 0;
  bool has_seed = false;
  uint64_t seed = 0;
};

bool ParseArgs(int argc, char** argv, Args* a, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    // `--name=value` as well as `--name value`.
    std::optional<std::string> inline_value;
    if (const size_t eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = flag.substr(eq + 1);
      flag.resize(eq);
    }
    for (size_t c = 2; c < flag.size(); ++c) {
      if (flag[c] == '_') flag[c] = '-';
    }
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (flag == "--version") {
      std::cout << "detour-train " << kVersion << " (" << kGitRevision << ")\n";
      std::exit(0);
    }
    if (!inline_value.has_value() && i + 1 >= argc) {
      *error = absl::StrCat(flag, " needs a value");
      return false;
    }
    const std::string v = inline_value.has_value() ? *inline_value : argv[++i];
    bool ok = true;
    if (flag == "--job")
      a->job = v;
    else if (flag == "--preset")
      a->preset = v;
    else if (flag == "--out")
      a->out = v;
    else if (flag == "--device")
      a->device = v;
    else if (flag == "--runs")
      a->runs = v;
    else if (flag == "--plan")
      a->plans.push_back(v);
    else if (flag == "--iterations")
      ok = absl::SimpleAtoi(v, &a->iterations) && a->iterations > 0;
    else if (flag == "--microbatches")
      ok = absl::SimpleAtoi(v, &a->microbatches) && a->microbatches > 0;
    else if (flag == "--samples")
      ok = absl::SimpleAtoi(v, &a->samples) && a->samples > 0;
    else if (flag == "--warmup")
      ok = absl::SimpleAtoi(v, &a->warmup) && a->warmup >= 0;
    else if (flag == "--eval-every")
      ok = absl::SimpleAtoi(v, &a->eval_every) && a->eval_every > 0;
    else if (flag == "--eval-samples")
      ok = absl::SimpleAtoi(v, &a->eval_samples) && a->eval_samples > 0;
    else if (flag == "--threads")
      ok = absl::SimpleAtoi(v, &a->threads) && a->threads > 0;
    else if (flag == "--lr")
      ok = absl::SimpleAtod(v, &a->lr) && a->lr > 0;
    else if (flag == "--optimizer")
      ok = (a->optimizer = v) == "adamw" || v == "kfac";
    else if (flag == "--precision")
      ok = (a->precision = v) == "fp32" || v == "bf16";
    else if (flag == "--kfac-lr")
      ok = absl::SimpleAtod(v, &a->kfac_lr) && a->kfac_lr > 0;
    else if (flag == "--kfac-damping")
      ok = absl::SimpleAtod(v, &a->kfac_damping) && a->kfac_damping > 0;
    else if (flag == "--kfac-momentum")
      ok = absl::SimpleAtod(v, &a->kfac_momentum) && a->kfac_momentum >= 0 && a->kfac_momentum < 1;
    else if (flag == "--kfac-kl-clip")
      ok = absl::SimpleAtod(v, &a->kfac_kl_clip) && a->kfac_kl_clip != 0;
    else if (flag == "--kfac-refresh")
      ok = absl::SimpleAtoi(v, &a->kfac_refresh) && a->kfac_refresh >= 0;
    else if (flag == "--kfac-update")
      ok = (a->kfac_update = v) == "graft" || v == "momentum";
    else if (flag == "--kfac-factor-decay")
      ok = absl::SimpleAtod(v, &a->kfac_factor_decay) && a->kfac_factor_decay > 0 &&
           a->kfac_factor_decay <= 1;
    else if (flag == "--kfac-curvature")
      ok = absl::SimpleAtoi(v, &a->kfac_curvature) && a->kfac_curvature > 0;
    else if (flag == "--seed")
      ok = a->has_seed = absl::SimpleAtoi(v, &a->seed);
    else {
      *error = absl::StrCat("unknown flag ", flag);
      return false;
    }
    if (!ok) {
      *error = absl::StrCat(flag, ": bad value \"", v, "\"");
      return false;
    }
  }
  return true;
}

absl::StatusOr<std::vector<Run>> ParseRuns(const std::string& text) {
  std::vector<Run> runs;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(item, ':');
    Run r;
    if (f.size() == 6 && (f[5] == "fp32" || f[5] == "bf16")) {
      r.precision = f[5];
      f.pop_back();
    }
    if (f.size() == 5 && (f[4] == "adamw" || f[4] == "kfac")) {
      r.optimizer = f[4];
      f.pop_back();
    }
    if (f.size() != 4 || f[0].empty() || !absl::SimpleAtoi(f[1], &r.stages) ||
        !absl::SimpleAtod(f[2], &r.skip) || !absl::SimpleAtoi(f[3], &r.swaps) || r.stages < 1 ||
        r.skip < 0 || r.skip >= 1 || r.swaps < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--runs: \"", item, "\" is not NAME:STAGES:SKIP:SWAPS[:adamw|kfac][:fp32|bf16]"));
    }
    r.name = f[0];
    runs.push_back(r);
  }
  return runs;
}

struct Curve {
  std::string name;
  std::vector<double> train;                    // per iteration
  std::vector<std::pair<int64_t, double>> val;  // (iteration, loss)
  double seconds = 0;
  int visited = 0;
  int stages = 0;
};

// Training loss as a 10-iteration moving average per run, validation losses
// as dots in the same colour.
std::string Svg(const std::vector<Curve>& curves, int64_t iterations) {
  std::vector<PlotSeries> series;
  for (size_t k = 0; k < curves.size(); ++k) {
    const Curve& c = curves[k];
    PlotSeries train{c.name, {}, false, static_cast<int>(k)};
    double acc = 0;
    for (size_t i = 0; i < c.train.size(); ++i) {
      acc += c.train[i];
      if (i >= 10) acc -= c.train[i - 10];
      train.points.emplace_back(static_cast<double>(i), acc / std::min<size_t>(i + 1, 10));
    }
    PlotSeries val{"", {}, true, static_cast<int>(k)};
    for (const auto& [it, v] : c.val) val.points.emplace_back(static_cast<double>(it), v);
    series.push_back(std::move(train));
    series.push_back(std::move(val));
  }
  PlotOptions options;
  options.title = absl::StrFormat(
      "training loss (10-iteration moving average), dots: validation; %d iterations", iterations);
  options.max_y_span = 4.0;  // the first iterations would squash the rest
  options.width = 900;
  return LinePlotSvg(series, options);
}

absl::Status WriteFile(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.flush();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path.string()));
  return absl::OkStatus();
}

// The K-FAC settings that --kfac-* override.
void ApplyKfacFlags(const Args& args, v1::KfacSpec* kfac) {
  if (args.kfac_lr > 0) kfac->set_lr(args.kfac_lr);
  if (args.kfac_damping > 0) kfac->set_damping(args.kfac_damping);
  if (args.kfac_momentum >= 0) kfac->set_momentum(args.kfac_momentum);
  if (args.kfac_kl_clip != 0) kfac->set_kl_clip(args.kfac_kl_clip);
  if (args.kfac_refresh >= 0) kfac->set_refresh_interval(static_cast<uint32_t>(args.kfac_refresh));
  if (args.kfac_update == "graft") kfac->set_update(v1::KFAC_UPDATE_GRAFT_ADAMW);
  if (args.kfac_update == "momentum") kfac->set_update(v1::KFAC_UPDATE_MOMENTUM);
  if (args.kfac_factor_decay > 0) kfac->set_factor_decay(args.kfac_factor_decay);
  if (args.kfac_curvature > 0) {
    kfac->set_curvature_microbatches(static_cast<uint32_t>(args.kfac_curvature));
  }
}

// The job every run starts from: --job, or a small one for --preset, with
// the flags' overrides and the defaults filled in.
absl::StatusOr<v1::JobSpec> BaseJobSpec(const Args& args) {
  v1::JobSpec base;
  if (!args.job.empty()) {
    ASSIGN_OR_RETURN(base, LoadJobSpec(args.job));
  } else {
    base.set_name("detour-train");
    base.mutable_model()->set_preset(args.preset);
    base.mutable_pipeline()->set_samples_per_microbatch(2);
    base.mutable_optimizer()->mutable_adamw()->set_lr(3e-3);
    base.mutable_optimizer()->set_warmup_iterations(20);
  }
  base.set_iterations(static_cast<uint64_t>(args.iterations));
  if (args.has_seed) base.set_seed(args.seed);
  if (args.microbatches > 0) {
    base.mutable_pipeline()->set_microbatches_per_data_node(args.microbatches);
    base.mutable_pipeline()->set_data_nodes(1);
  }
  if (args.samples > 0) base.mutable_pipeline()->set_samples_per_microbatch(args.samples);
  if (args.lr > 0) base.mutable_optimizer()->mutable_adamw()->set_lr(args.lr);
  if (args.warmup >= 0) base.mutable_optimizer()->set_warmup_iterations(args.warmup);
  if (args.optimizer == "kfac") base.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
  if (args.optimizer == "adamw") base.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  if (args.precision == "fp32") base.mutable_pipeline()->set_precision(v1::PRECISION_FP32);
  if (args.precision == "bf16") base.mutable_pipeline()->set_precision(v1::PRECISION_BF16);
  ApplyKfacFlags(args, base.mutable_optimizer()->mutable_kfac());
  ApplyJobDefaults(&base);
  return base;
}

// A --plan NAME:FILE run, which trains on the routes of FILE every iteration.
absl::StatusOr<Run> PlanRun(const std::string& plan, const Args& args, const v1::JobSpec& base) {
  const size_t colon = plan.find(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--plan: \"", plan, "\" is not NAME:FILE"));
  }
  std::ifstream in(plan.substr(colon + 1));
  if (!in) return absl::NotFoundError(absl::StrCat("--plan: cannot open ", plan.substr(colon + 1)));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Run r;
  r.name = plan.substr(0, colon);
  ASSIGN_OR_RETURN(r.fixed_routes, model::ParseRoutesJson(text));
  if (r.fixed_routes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--plan ", plan, ": no routes"));
  }
  int highest = 0;
  for (const auto& route : r.fixed_routes) {
    for (uint32_t st : route.stages()) highest = std::max(highest, static_cast<int>(st));
  }
  r.stages = args.job.empty() ? highest + 1 : static_cast<int>(base.pipeline().num_stages());
  return r;
}

// The runs of --runs, then those of --plan; at least one.
absl::StatusOr<std::vector<Run>> CollectRuns(const Args& args, const v1::JobSpec& base) {
  ASSIGN_OR_RETURN(std::vector<Run> runs, ParseRuns(args.runs));
  for (const std::string& plan : args.plans) {
    ASSIGN_OR_RETURN(Run r, PlanRun(plan, args, base));
    runs.push_back(std::move(r));
  }
  if (runs.empty()) return absl::InvalidArgumentError("no run: give --runs or --plan");
  return runs;
}

// The job one run trains: the base job with the run's stages, skipping,
// swaps, optimiser and precision.
v1::JobSpec RunJobSpec(const Run& run, const v1::JobSpec& base, int run_mbs) {
  v1::JobSpec spec = base;
  spec.mutable_pipeline()->set_num_stages(run.stages);
  spec.mutable_pipeline()->set_skip_ratio(run.skip);
  spec.mutable_pipeline()->set_max_swaps(run.swaps);
  if (run.optimizer == "kfac") spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
  if (run.optimizer == "adamw") spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  if (run.precision == "fp32") spec.mutable_pipeline()->set_precision(v1::PRECISION_FP32);
  if (run.precision == "bf16") spec.mutable_pipeline()->set_precision(v1::PRECISION_BF16);
  if (!run.fixed_routes.empty()) {
    // One data stream of as many microbatches as the plan has routes; the
    // in-process engine needs no node identities.
    spec.mutable_pipeline()->set_data_nodes(1);
    spec.mutable_pipeline()->set_replicas_per_stage(1);
    spec.mutable_pipeline()->set_microbatches_per_data_node(run_mbs);
    spec.mutable_pipeline()->set_skip_ratio(0);
  }
  return spec;
}

// Trains one run from the shared seed, appends a line per iteration to `csv`
// and saves the final weights to --out/ckpt-<run>.
absl::StatusOr<Curve> TrainRun(const Run& run, const v1::JobSpec& base, const Args& args,
                               const model::TextDataset& data, const c10::Device& device,
                               int total_mbs, std::string* csv) {
  const int run_mbs =
      run.fixed_routes.empty() ? total_mbs : static_cast<int>(run.fixed_routes.size());
  const v1::JobSpec spec = RunJobSpec(run, base, run_mbs);
  if (run.fixed_routes.empty()) {
    RETURN_IF_ERROR(Annotate(ValidateJobSpec(spec), run.name));
  }
  ASSIGN_OR_RETURN(auto engine, PipelineEngine::Create(spec, device));
  Curve curve;
  curve.name = run.name;
  curve.stages = run.stages;
  curve.visited =
      run.fixed_routes.empty() ? VisitedStages(spec.pipeline()) : run.fixed_routes[0].stages_size();
  const absl::Time start = absl::Now();
  absl::Duration evaluating;
  for (int64_t it = 0; it < args.iterations; ++it) {
    std::vector<v1::Route> routes = run.fixed_routes;
    if (routes.empty()) {
      ASSIGN_OR_RETURN(routes, model::GenerateRoutes(spec.pipeline(), run_mbs, spec.seed(), it));
    }
    ASSIGN_OR_RETURN(auto mbs, model::IterationMicrobatches(spec, data.train, it, device));
    ASSIGN_OR_RETURN(auto stats, engine->RunIteration(it, routes, mbs));
    curve.train.push_back(stats.loss);
    std::string val;
    const absl::Time trained = absl::Now();
    if ((it + 1) % args.eval_every == 0 || it + 1 == args.iterations) {
      model::EvalOptions eo;
      eo.max_samples = args.eval_samples;
      ASSIGN_OR_RETURN(auto r, model::Perplexity(engine->stages(), data.validation, eo));
      curve.val.emplace_back(it, r.mean_nll);
      val = absl::StrFormat("%.5f", r.mean_nll);
      std::printf("%-12s it %5lld  train %.4f  val %.4f  (%.0f s)\n", run.name.c_str(),
                  static_cast<long long>(it + 1), stats.loss, r.mean_nll,
                  absl::ToDoubleSeconds(absl::Now() - start));
      std::fflush(stdout);
    }
    evaluating += absl::Now() - trained;
    absl::StrAppendFormat(csv, "%s,%d,%.5f,%s,%.6g,%.4f,%.2f,%.2f\n", run.name, it, stats.loss, val,
                          stats.learning_rate, stats.grad_norm,
                          absl::ToDoubleSeconds(absl::Now() - start),
                          absl::ToDoubleSeconds(absl::Now() - start - evaluating));
  }
  curve.seconds = absl::ToDoubleSeconds(absl::Now() - start - evaluating);
  const fs::path ckpt = fs::path(args.out) / absl::StrCat("ckpt-", run.name);
  std::error_code ec;
  fs::remove_all(ckpt, ec);
  RETURN_IF_ERROR(
      model::SaveCheckpoint(ckpt.string(), *engine, static_cast<uint64_t>(args.iterations), ""));
  return curve;
}

// The perplexity table: every run's final weights, re-split one layer per
// stage (checkpoints are keyed by global layer), so all runs are measured on
// the same layer subsets. Writes results.md and results.csv and prints the
// table.
absl::Status ReportPerplexity(const std::vector<Curve>& curves, const v1::JobSpec& base,
                              const Args& args, const model::TextDataset& data,
                              const c10::Device& device) {
  const int layers = static_cast<int>(base.model().num_layers());
  v1::JobSpec eval_spec = base;
  eval_spec.mutable_pipeline()->set_num_stages(layers);
  eval_spec.mutable_pipeline()->set_skip_ratio(0);
  // One yardstick for every run, whatever precision it trained in.
  eval_spec.mutable_pipeline()->set_precision(v1::PRECISION_FP32);
  std::vector<int> all;
  for (int l = 0; l < layers; ++l) all.push_back(l);
  const std::vector<int> every_other = model::SpreadRoute(layers, 0.5);
  std::vector<int> first_half(all.begin(), all.begin() + (layers + 1) / 2);
  std::string table =
      absl::StrCat("| run | stages | visited | train s | final train loss | ppl all ", layers,
                   " layers | ppl half, layers {", absl::StrJoin(every_other, ","),
                   "} | ratio | ppl half, layers {", absl::StrJoin(first_half, ","),
                   "} | ratio |\n|---|---|---|---|---|---|---|---|---|---|\n");
  std::string results_csv =
      "run,stages,visited,train_seconds,final_train_loss,final_val_loss,ppl_all,"
      "ppl_every_other,ppl_first_half\n";
  for (const Curve& c : curves) {
    ASSIGN_OR_RETURN(auto engine, PipelineEngine::Create(eval_spec, device));
    const fs::path ckpt = fs::path(args.out) / absl::StrCat("ckpt-", c.name);
    ASSIGN_OR_RETURN(auto manifest, model::LoadCheckpoint(ckpt.string(), *engine));
    (void)manifest;
    model::EvalOptions eo;
    eo.max_samples = 4 * args.eval_samples;
    double ppl[3];
    const std::vector<int>* routes[3] = {&all, &every_other, &first_half};
    for (int k = 0; k < 3; ++k) {
      eo.route = *routes[k];
      ASSIGN_OR_RETURN(auto r, model::Perplexity(engine->stages(), data.validation, eo));
      ppl[k] = r.perplexity;
    }
    double tail = 0;
    const size_t n = std::min<size_t>(10, c.train.size());
    for (size_t i = c.train.size() - n; i < c.train.size(); ++i) tail += c.train[i] / n;
    absl::StrAppendFormat(&table,
                          "| %s | %d | %d | %.0f | %.3f | %.3f | %.3f | %.2fx | %.3f | %.2fx |\n",
                          c.name, c.stages, c.visited, c.seconds, tail, ppl[0], ppl[1],
                          ppl[1] / ppl[0], ppl[2], ppl[2] / ppl[0]);
    absl::StrAppendFormat(&results_csv, "%s,%d,%d,%.2f,%.5f,%.5f,%.5f,%.5f,%.5f\n", c.name,
                          c.stages, c.visited, c.seconds, tail,
                          c.val.empty() ? NAN : c.val.back().second, ppl[0], ppl[1], ppl[2]);
  }
  RETURN_IF_ERROR(WriteFile(fs::path(args.out) / "results.md", table));
  RETURN_IF_ERROR(WriteFile(fs::path(args.out) / "results.csv", results_csv));
  std::printf("\n%s\nwrote %s/{loss.csv,loss.svg,results.md,results.csv,ckpt-*}\n", table.c_str(),
              args.out.c_str());
  return absl::OkStatus();
}

absl::Status Main(const Args& args) {
  at::set_num_threads(static_cast<int>(args.threads));
  if (args.device != "cpu" && !(args.device.rfind("cuda", 0) == 0 && at::hasCUDA())) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device ", args.device, ": this LibTorch build has no such device"));
  }
  const c10::Device device(args.device);
  ASSIGN_OR_RETURN(const v1::JobSpec base, BaseJobSpec(args));
  ASSIGN_OR_RETURN(const std::vector<Run> runs, CollectRuns(args, base));
  ASSIGN_OR_RETURN(const model::TextDataset data, model::LoadDataset(base.data()));
  RETURN_IF_ERROR(model::CheckVocabulary(data, static_cast<int>(base.model().vocab_size())));
  const int total_mbs =
      static_cast<int>(base.pipeline().data_nodes() * base.pipeline().microbatches_per_data_node());
  std::error_code ec;
  fs::create_directories(args.out, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", args.out));
  std::printf(
      "model %s, %d microbatches x %u samples x %u tokens, %lld iterations, "
      "train %zu / validation %zu tokens\n",
      base.model().preset().c_str(), total_mbs, base.pipeline().samples_per_microbatch(),
      base.model().context_length(), static_cast<long long>(args.iterations), data.train.size(),
      data.validation.size());

  std::vector<Curve> curves;
  // seconds: since the run started; train_seconds: the same without the
  // validation passes (what equal-wall-time comparisons use).
  std::string csv = "run,iteration,train_loss,val_loss,lr,grad_norm,seconds,train_seconds\n";
  for (const Run& run : runs) {
    ASSIGN_OR_RETURN(Curve curve, TrainRun(run, base, args, data, device, total_mbs, &csv));
    curves.push_back(std::move(curve));
  }
  RETURN_IF_ERROR(WriteFile(fs::path(args.out) / "loss.csv", csv));
  RETURN_IF_ERROR(WriteFile(fs::path(args.out) / "loss.svg", Svg(curves, args.iterations)));
  return ReportPerplexity(curves, base, args, data, device);
}

}  // namespace
}  // namespace detour::train_tool

int main(int argc, char** argv) {
  detour::train_tool::Args args;
  std::string error;
  if (!detour::train_tool::ParseArgs(argc, argv, &args, &error)) {
    std::fprintf(stderr, "detour-train: %s\n\n%s", error.c_str(), detour::train_tool::kUsage);
    return 2;
  }
  absl::Status s = detour::train_tool::Main(args);
  if (!s.ok()) {
    std::fprintf(stderr, "detour-train: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
