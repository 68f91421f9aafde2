#!/usr/bin/env python3
"""Stage reassignment: what moving a spare replica to a thin, slow stage buys.

One job (a small model — 3 blocks, d_model 64, context 32 — in 3 stages: 1 data
node, 2 replicas of stages 1 and 2, skippipe routes over all stages, 8
microbatches of 2 samples per iteration) on five workers of
this machine, pinned w0 | w1 w2 | w3 w4, where w4 runs every compute task
--slowdown times slower (detour-worker --compute_slowdown). The coordinator
re-plans with measured speeds every 2 iterations, so routes avoid w4 while its
fast replica w3 lives. At iteration --kill-at w3 is killed (SIGKILL): stage 2 is
left with the slow w4 alone while stage 1 keeps two fast replicas.

  stay  elastic.reassign_disabled: every route goes through w4 from then on;
  move  the default: at the next iteration boundary the planner predicts that
        moving w1 or w2 to stage 2 repays its cost, and the worker moves (state
        from w4, checksum-checked).

Prints per run: seconds per iteration before the kill and after it (wall time
over iterations, polled), the job's wall time, and the move's own stall as the
REASSIGNED event reports it. Both runs share this machine: compare them with
each other, not with other machines.

  benchmarks/runtime/stage_moves.py [--build build] [--iterations 30] [--kill-at 8]
"""
import json
import os
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_daemons import ROOT, LocalCluster, benchmark_parser, parse_benchmark_args  # noqa: E402,E501



class Cluster(LocalCluster):
    """Five local workers under a coordinator that re-plans every 2 iterations;
    a worker's --compute_slowdown makes it slow."""

    def __init__(self, args, name):
        super().__init__(args.build, f"detour-moves-{name}-", ["--replan_every=2"])

    def start_worker(self, wid, slowdown):
        return super().start_worker(wid, "local", [f"--compute_slowdown={slowdown}"])


def job_spec(args, move):
    return {
        "name": "moves",
        "model": {"num_layers": 3, "d_model": 64, "num_heads": 2, "ffn_dim": 128,
                  "context_length": 32},
        "pipeline": {"num_stages": 3, "data_nodes": 1, "replicas_per_stage": 2,
                     "microbatches_per_data_node": 8, "samples_per_microbatch": 2,
                     "skip_ratio": 0, "scheduler": "SCHEDULER_SKIPPIPE", "memory_slots": 3,
                     "assignment": [{"nodes": ["w0"]}, {"nodes": ["w1", "w2"]},
                                    {"nodes": ["w3", "w4"]}]},
        "optimizer": {"adamw": {"lr": 1e-3}},
        "iterations": args.iterations, "seed": 5,
        "checkpoint": {"disabled": True},
        "elastic": {"reconnect_grace_ms": 500, "reassign_disabled": not move,
                    "reassign_horizon_iterations": args.horizon},
    }


def run(args, mode):
    c = Cluster(args, mode)
    try:
        for i in range(5):
            c.start_worker(f"w{i}", args.slowdown if i == 4 else 1)
        spec_path = os.path.join(c.dir, "job.json")
        json.dump(job_spec(args, move=(mode == "move")), open(spec_path, "w"))
        jid = c.ctl("submit", spec_path)["id"]
        start = killed = None
        at_kill = 0
        while True:
            j = c.ctl("get", jid)
            state = j.get("state", "")
            it = int(j.get("progress", {}).get("iteration", 0))
            if start is None and state == "JOB_STATE_RUNNING" and it >= 1:
                start, start_it = time.time(), it
            if state == "JOB_STATE_SUCCEEDED":
                end = time.time()
                break
            if state in ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED"):
                raise RuntimeError(f"{mode}: job ended: {j.get('message')}")
            if killed is None and it >= args.kill_at:
                c.procs["w3"].send_signal(signal.SIGKILL)
                killed, at_kill = time.time(), it
            time.sleep(0.05)
        moved = [e.get("message", "") for e in j.get("history", [])
                 if e.get("kind") == "KIND_REASSIGNED"]
        stall = None
        if moved:
            m = re.search(r" in ([0-9.]+)(ms|s) ", moved[0])
            if m:
                stall = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
        return {
            "mode": mode,
            "before_s": (killed - start) / max(1, at_kill - start_it),
            "after_s": (end - killed) / max(1, args.iterations - at_kill),
            "wall_s": end - start, "moves": len(moved), "move_stall_s": stall,
            "move": moved[0] if moved else "",
        }
    finally:
        c.stop()


def main():
    ap = benchmark_parser(__doc__, 30, ("stay", "move"))
    ap.add_argument("--kill-at", type=int, default=8,
                    help="iteration at which the fast replica w3 is killed (default: %(default)s)")
    ap.add_argument("--slowdown", type=float, default=8,
                    help="how many times slower w4 computes (default: %(default)s)")
    ap.add_argument("--horizon", type=int, default=20,
                    help="elastic.reassign_horizon_iterations: the iterations a move must "
                         "repay its cost within (default: %(default)s)")
    args = parse_benchmark_args(ap)
    if not 1 <= args.kill_at < args.iterations - 2:
        ap.error("--kill-at must be at least 1 and leave 3 iterations after it "
                 f"(--iterations {args.iterations})")
    if not args.slowdown >= 1 or args.horizon < 1:
        ap.error("--slowdown must be at least 1 and --horizon at least 1")
    results = []
    for mode in args.modes.split(","):
        print(f"== {mode}", file=sys.stderr, flush=True)
        results.append(run(args, mode))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{'run':6} {'s/it before':>11} {'s/it after':>10} {'wall s':>7} {'moves':>5} "
          f"{'stall s':>7}")
    for r in results:
        stall = f"{r['move_stall_s']:.3f}" if r["move_stall_s"] is not None else "-"
        print(f"{r['mode']:6} {r['before_s']:11.3f} {r['after_s']:10.3f} {r['wall_s']:7.1f} "
              f"{r['moves']:5d} {stall:>7}")
    for r in results:
        if r["move"]:
            print(f"{r['mode']}: {r['move']}")


if __name__ == "__main__":
    main()
