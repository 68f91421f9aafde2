#!/usr/bin/env python3
"""Quality on real text: skipping and K-FAC against the full pipeline with AdamW.

Builds a corpus of real English text that ships with the OS, trains a subword
tokenizer on it and prepares a dataset with detour-data, then runs detour-train
(the in-process engine) for every seed with four runs from the same weights on
the same data order:

  full    4 stages, every microbatch visits all of them (AdamW)
  skip25  4 stages, 25% skip: each microbatch visits 3 (AdamW)
  skip33  6 stages, 33% skip: each microbatch visits 4 (AdamW)
  kfac    4 stages, full routes, K-FAC (grafted onto AdamW's step length,
          refresh every 2 iterations, factor decay 0.5: docs/MODEL.md §K-FAC)

and prints markdown tables (also written to OUT/study.md, with the raw numbers
in OUT/study.json):

  1. equal iterations: final validation loss and perplexity with all blocks,
     with every other block {0,2,4,6} and with the first half {0,1,2,3} (every
     run's final checkpoint re-loaded one block per stage), per run, mean and
     spread over the seeds;
  2. equal wall time, from the same runs' loss.csv: within each seed, the time
     budget is the shortest training time of the runs compared (validation
     passes left out: loss.csv's train_seconds); per run the iterations done
     within it, the mean training loss of the last 10 of them, and the
     validation loss at its last evaluation inside the budget ("–" when none
     fell inside).
     Skipping is compared with full at the budget of the fastest of the
     three, K-FAC with AdamW at the budget of the faster of the two.

Corpus (--corpus): "copyright" (default) = /usr/share/common-licenses/* and
/usr/share/doc/*/copyright, paragraphs deduplicated (exact, whitespace-trimmed:
the same license text ships with hundreds of packages, and a duplicate in the
validation split would be memorised, not predicted), in path order, cut at
--corpus-bytes. Which packages are installed decides the text: the corpus's
size and SHA-256 are printed and recorded so runs can be compared.

Wall times are of the in-process engine on one CPU thread: they measure the
compute a run spends (skipping visits fewer blocks per microbatch), not the
pipeline's network gain on a geo-distributed cluster (docs/SCHEDULER.md has
that). Runs are sequential: on a shared machine their timings drift with the
load, which is printed next to the results.

  benchmarks/model/quality_study.py --build build --out /tmp/study \\
      [--iterations 600] [--seeds 0,1] [--vocab 4000] [--corpus-bytes 0] \\
      [--stop-after-minutes M] [--max-runs N] [--jobs N]

--jobs N runs N trainings at once (default 1; the runs of one kind for the
seeds side by side). The BLAS decides float32 speed: the file libblas.so.3
resolves to is recorded (settings.json, the table header), and the full study
takes 12 minutes on 2 cores with OpenBLAS in front, about 3.6 CPU-hours on
Debian's reference BLAS (docs/MODEL.md).

Each (seed, run) is one detour-train process writing OUT/seed-S/RUN/; rerun
the same command to continue an interrupted study, or one stopped by
--stop-after-minutes or --max-runs (finished runs are kept, an unfinished
one starts again).

A smoke-size run (about 10 minutes on 2 loaded cores): --iterations 40
--eval-every 10 --eval-samples 16 --corpus-bytes 1000000 --vocab 1000
--precision bf16. The full study's command and its measured cost:
docs/MODEL.md §"Quality on real text: the study driver".
"""
import argparse
import csv
import glob
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

RUNS = [
    ("full", "full:4:0:0:adamw"),
    ("skip25", "skip25:4:0.25:0:adamw"),
    ("skip33", "skip33:6:0.3333:0:adamw"),
    ("kfac", "kfac:4:0:0:kfac"),
]


def resolved_blas(binary):
    """The file libblas.so.3 resolves to for `binary` (ldd, this environment)."""
    try:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (ldd failed)"
    for line in out.splitlines():
        if line.strip().startswith("libblas.so"):
            path = line.split("=>")[-1].split("(")[0].strip()
            return os.path.realpath(path) if path else "unknown"
    return "none (not linked)"


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def build_corpus(out_path, max_bytes):
    files = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(
        glob.glob("/usr/share/doc/*/copyright"))
    seen = set()
    kept, dropped, used_files, total = [], 0, 0, 0
    full = False
    for path in files:
        if full:
            break
        if not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        used = False
        for para in text.replace("\r\n", "\n").split("\n\n"):
            p = para.strip("\n")
            key = p.strip()
            if not key:
                continue
            if key in seen:
                dropped += 1
                continue
            if max_bytes and total + len(p.encode()) + 2 > max_bytes:
                full = True
                break
            seen.add(key)
            kept.append(p)
            total += len(p.encode()) + 2
            used = True
        used_files += used
    body = "\n\n".join(kept) + "\n"
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(body)
    digest = hashlib.sha256(body.encode()).hexdigest()
    return {"files": used_files, "paragraphs": len(kept), "duplicates_dropped": dropped,
            "bytes": len(body.encode()), "sha256": digest}


def run(cmd, log):
    print("+ " + " ".join(cmd), flush=True)
    with open(log, "a") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}; see {log}")


def read_curves(path):
    curves = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            c = curves.setdefault(row["run"], [])
            c.append(row)
    return curves


def read_results(path):
    with open(path) as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def at_budget(rows, budget):
    """The last validation point of a run within `budget` training seconds."""
    best = None
    for r in rows:
        if r["val_loss"] and float(r["train_seconds"]) <= budget + 1e-9:
            best = (int(r["iteration"]) + 1, float(r["val_loss"]), float(r["train_seconds"]))
    return best


def train_at_budget(rows, budget, window=10):
    """Mean training loss of the last `window` iterations within `budget`."""
    inside = [float(r["train_loss"]) for r in rows if float(r["train_seconds"]) <= budget + 1e-9]
    if not inside:
        return None
    tail = inside[-window:]
    return sum(tail) / len(tail)


def fmt(values, digits=3):
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    m = statistics.mean(values)
    if len(values) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {(max(values) - min(values)) / 2:.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--out", default="/tmp/detour-quality-study")
    ap.add_argument("--corpus", default="copyright", choices=["copyright"])
    ap.add_argument("--corpus-bytes", type=int, default=0, help="0 = all of it")
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--tokenizer-type", default="bpe", choices=["bpe", "unigram"])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--iterations", type=int, default=600)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=0, help="0 = iterations/20")
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--stop-after-minutes", type=float, default=0,
                    help="start no further run after this many minutes (0 = no limit); "
                         "the same command later continues with the runs not done")
    ap.add_argument("--jobs", type=int, default=1,
                    help="trainings at once (each uses --threads threads); runs of the same "
                    "kind for different seeds go side by side")
    ap.add_argument("--max-runs", type=int, default=0,
                    help="start at most this many trainings (0 = no limit); the same "
                         "command later continues with the runs not done")
    args = ap.parse_args()

    tools = os.path.join(args.build, "tools")
    data_tool = os.path.join(tools, "detour_data", "detour-data")
    train_tool = os.path.join(tools, "detour_train", "detour-train")
    for t in (data_tool, train_tool):
        if not os.access(t, os.X_OK):
            sys.exit(f"{t} is missing: cmake --build {args.build} --target detour_data_tool "
                     "detour_train_tool")
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "study.log")
    started = time.time()
    load_start = loadavg()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    eval_every = args.eval_every or max(1, args.iterations // 20)

    corpus_path = os.path.join(args.out, "corpus.txt")
    corpus = build_corpus(corpus_path, args.corpus_bytes)
    print(f"corpus: {corpus['bytes'] / 1e6:.2f} MB, {corpus['paragraphs']} paragraphs from "
          f"{corpus['files']} files ({corpus['duplicates_dropped']} duplicate paragraphs "
          f"dropped), sha256 {corpus['sha256'][:16]}", flush=True)
    model = os.path.join(args.out, "sp.model")
    dataset = os.path.join(args.out, "dataset")
    # Every run is its own detour-train process writing seed-S/RUN/, so an
    # interrupted study continues where it stopped when the same command runs
    # again (a run gives the same numbers alone as beside the others: each
    # starts from the seed's weights and data order). settings.json guards
    # against mixing runs of different settings or corpora in one --out.
    settings = {k: v for k, v in vars(args).items()
                if k not in ("build", "out", "stop_after_minutes", "max_runs")}
    settings["corpus_sha256"] = corpus["sha256"]
    # The BLAS decides float32 speed (Debian's reference BLAS is 10-15x slower
    # than OpenBLAS here): record which one the trainings load, and refuse to
    # mix runs on different ones in one --out.
    settings["blas"] = resolved_blas(train_tool)
    print(f"BLAS: {settings['blas']}", flush=True)
    settings_path = os.path.join(args.out, "settings.json")
    if os.path.exists(settings_path):
        with open(settings_path) as f:
            previous = json.load(f)
        if previous != settings:
            diff = sorted(k for k in set(previous) | set(settings)
                          if previous.get(k) != settings.get(k))
            sys.exit(f"{args.out} holds a study with other settings ({', '.join(diff)}); "
                     "use another --out or remove it")
    reuse = os.path.exists(settings_path) and os.path.exists(
        os.path.join(dataset, "manifest.json")) and os.path.exists(model)
    if reuse:
        print(f"continuing the study in {args.out} (tokenizer and dataset reused)", flush=True)
    else:
        run([data_tool, "tokenizer", "--output", model, "--vocab_size", str(args.vocab),
             "--type", args.tokenizer_type, "--threads", "1", corpus_path], log)
        run([data_tool, "prepare", "--output", dataset, "--tokenizer", model, "--force",
             "--quiet", corpus_path], log)
        with open(settings_path + ".tmp", "w") as f:
            json.dump(settings, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(settings_path + ".tmp", settings_path)
    with open(os.path.join(dataset, "manifest.json")) as f:
        manifest = json.load(f)
    job = {
        "name": "quality-study",
        "model": {"preset": args.preset, "vocab_size": int(manifest["vocab_size"])},
        "pipeline": {"data_nodes": 1, "microbatches_per_data_node": args.microbatches,
                     "samples_per_microbatch": args.samples,
                     "precision": "PRECISION_" + args.precision.upper()},
        "optimizer": {"adamw": {"lr": args.lr}, "warmup_iterations": args.warmup},
        "data": {"source": "DATA_SOURCE_SHARDS", "path": os.path.abspath(dataset)},
        "iterations": args.iterations,
    }
    job_path = os.path.join(args.out, "job.json")
    with open(job_path, "w") as f:
        json.dump(job, f, indent=2)

    run_loads = []  # 1-minute load averages at the start and end of every run
    per_seed = {seed: {"curves": {}, "results": {}} for seed in seeds}
    # The trainings not done yet, run kind by kind (full of every seed, then
    # skip25, ...): with --jobs 2 the two trainings running side by side are
    # of the same kind, so each kind's times carry the same sharing of the
    # memory system and the equal-time budgets stay comparable.
    todo = [(seed, name, spec) for name, spec in RUNS for seed in seeds
            if not os.path.exists(os.path.join(args.out, f"seed-{seed}", name, "results.csv"))]
    pending = 0
    started_runs = 0
    running = []  # (process, log file, out dir, load at start, command)

    def finish(entry):
        """Waits for a started training; stops the study (and the others) if it failed."""
        proc, logf, out, load_before, cmd = entry
        code = proc.wait()
        logf.close()
        running.remove(entry)
        if code != 0:
            for other in list(running):
                other[0].kill()
                other[0].wait()
                other[1].close()
                running.remove(other)
            sys.exit(f"failed ({code}): {' '.join(cmd)}; see {os.path.join(out, 'train.log')}")
        with open(os.path.join(out, "load.txt"), "w") as f:
            f.write(f"start {load_before}\nend {loadavg()}\n")
        print(f"{os.path.relpath(out, args.out)}: done", flush=True)

    for seed, name, spec in todo:
        minutes = (time.time() - started) / 60
        if ((args.stop_after_minutes and minutes >= args.stop_after_minutes) or
                (args.max_runs and started_runs >= args.max_runs)):
            pending += 1
            continue
        while len(running) >= args.jobs:
            ended = [e for e in running if e[0].poll() is not None]
            for e in ended:
                finish(e)
            if not ended:
                time.sleep(1)
        started_runs += 1
        out = os.path.join(args.out, f"seed-{seed}", name)
        os.makedirs(out, exist_ok=True)
        load_before = loadavg()
        cmd = [train_tool, "--job", job_path, "--seed", str(seed), "--iterations",
               str(args.iterations), "--runs", spec, "--eval-every", str(eval_every),
               "--eval-samples", str(args.eval_samples), "--kfac-refresh", "2",
               "--kfac-factor-decay", "0.5", "--threads", str(args.threads), "--out", out]
        print(f"seed {seed}, run {name}: started at load {load_before}", flush=True)
        print("+ " + " ".join(cmd), flush=True)
        logf = open(os.path.join(out, "train.log"), "w")
        running.append((subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT), logf, out,
                        load_before, cmd))
    while running:
        finish(running[0])
    for seed in seeds:
        for name, _ in RUNS:
            out = os.path.join(args.out, f"seed-{seed}", name)
            done = os.path.join(out, "results.csv")
            if not os.path.exists(done):
                continue
            with open(os.path.join(out, "load.txt")) as f:
                run_loads.extend(float(line.split()[1]) for line in f if line.strip())
            per_seed[seed]["curves"].update(read_curves(os.path.join(out, "loss.csv")))
            per_seed[seed]["results"].update(read_results(done))
    if pending:
        print(f"stopped ({started_runs} trainings started) with {pending} of "
              f"{len(seeds) * len(RUNS)} runs not done; run the same command again to "
              "continue", flush=True)
        return

    # Equal wall time: budgets per seed.
    budgets = {}
    for seed, d in per_seed.items():
        total = {name: float(d["curves"][name][-1]["train_seconds"]) for name, _ in RUNS}
        budgets[seed] = {"skip": min(total["full"], total["skip25"], total["skip33"]),
                         "kfac": min(total["full"], total["kfac"]), "total": total}

    summary = {"corpus": corpus, "manifest_vocab": manifest["vocab_size"],
               "train_tokens": manifest["train"]["tokens"],
               "validation_tokens": manifest["validation"]["tokens"], "args": vars(args),
               "load_start": load_start, "runs": {}}
    lines = []
    lines.append(f"Corpus: {corpus['bytes'] / 1e6:.2f} MB of /usr/share/common-licenses and "
                 f"/usr/share/doc/*/copyright ({corpus['paragraphs']} unique paragraphs from "
                 f"{corpus['files']} files, sha256 {corpus['sha256'][:16]}…), {args.tokenizer_type} "
                 f"vocabulary {manifest['vocab_size']}: {manifest['train']['tokens']} training / "
                 f"{manifest['validation']['tokens']} validation tokens. Model `{args.preset}`, "
                 f"{args.microbatches} microbatches × {args.samples} samples, {args.iterations} "
                 f"iterations, lr {args.lr}, {args.precision}, seeds {args.seeds} "
                 f"(mean ± half the spread). BLAS: {settings['blas']}.")
    lines.append("")
    lines.append("Equal iterations (validation, perplexity on the final checkpoints):")
    lines.append("")
    lines.append("| run | val loss | ppl all blocks | ppl blocks {0,2,4,6} | ratio | "
                 "ppl blocks {0,1,2,3} | ratio | train s |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for name, _ in RUNS:
        rows = [per_seed[s]["results"][name] for s in seeds]
        val = [float(r["final_val_loss"]) for r in rows]
        ppl = [float(r["ppl_all"]) for r in rows]
        eo = [float(r["ppl_every_other"]) for r in rows]
        fh = [float(r["ppl_first_half"]) for r in rows]
        secs = [float(r["train_seconds"]) for r in rows]
        summary["runs"][name] = {"val_loss": val, "ppl_all": ppl, "ppl_every_other": eo,
                                 "ppl_first_half": fh, "train_seconds": secs}
        lines.append(f"| {name} | {fmt(val)} | {fmt(ppl)} | {fmt(eo)} | "
                     f"{fmt([a / b for a, b in zip(eo, ppl)], 2)}× | {fmt(fh)} | "
                     f"{fmt([a / b for a, b in zip(fh, ppl)], 2)}× | {fmt(secs, 0)} |")
    lines.append("")
    lines.append("Equal wall time (validation loss at each run's last evaluation within the "
                 "budget = the shortest training time of the runs compared, per seed):")
    lines.append("")
    lines.append("| comparison | run | budget s | iterations in budget | train loss, last 10 "
                 "in budget | last evaluation in budget: iteration | val loss |")
    lines.append("|---|---|---|---|---|---|---|")
    for group, names in (("skip", ["full", "skip25", "skip33"]), ("kfac", ["full", "kfac"])):
        for name in names:
            rows = {s: per_seed[s]["curves"][name] for s in seeds}
            done = [sum(1 for r in rows[s] if float(r["train_seconds"]) <= budgets[s][group] + 1e-9)
                    for s in seeds]
            train = [train_at_budget(rows[s], budgets[s][group]) for s in seeds]
            pts = [at_budget(rows[s], budgets[s][group]) for s in seeds]
            its = [p[0] if p else None for p in pts]
            vals = [p[1] if p else None for p in pts]
            summary["runs"][name][f"equal_time_{group}"] = {
                "budget_s": [budgets[s][group] for s in seeds], "iterations": done,
                "train_loss_last10": train, "eval_iteration": its, "val_loss": vals}
            label = "skipping vs full" if group == "skip" else "K-FAC vs AdamW"
            lines.append(f"| {label} | {name} | {fmt([budgets[s][group] for s in seeds], 0)} | "
                         f"{fmt(done, 0)} | {fmt(train)} | {fmt(its, 0)} | {fmt(vals)} |")
    load_end = loadavg()
    summary["load_end"] = load_end
    summary["wall_s"] = time.time() - started
    lines.append("")
    summary["run_load_range"] = [min(run_loads), max(run_loads)]
    lines.append(f"Load average (1 min) at the starts and ends of the runs: "
                 f"{min(run_loads):.1f}–{max(run_loads):.1f}; this invocation: {load_start} "
                 f"at the start, {load_end} at the end (1/5/15 min), "
                 f"{summary['wall_s'] / 60:.1f} min.")
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    with open(os.path.join(args.out, "study.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "study.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
