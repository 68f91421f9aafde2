#!/usr/bin/env python3
"""Elastic training under churn, on an emulated geo-distributed cluster.

Three runs of the same job (the tiny model, 6 stages, 2 data nodes, 2 replicas of
every other stage, 33% skip) on 12 workers whose frames are delayed and
rate-limited per examples/clusters/geo12.json, plus spare workers:

  none     no failures (the baseline throughput);
  elastic  every --kill-every iterations a random worker of the job is killed
           (SIGKILL) and a fresh worker process is started in its region; the
           job re-plans around the loss and the newcomer joins;
  restart  the same kills with elastic.disabled: each kill fails the job, the
           fresh worker is started, and `detourctl resume` restarts the job from
           its newest checkpoint (every --checkpoint-every iterations).

Prints, per run: wall time, tokens/s and tokens per hour vs the baseline,
recoveries, the coordinator's recovery time (detection -> running again; mean
and max from detour_coordinator_recovery_seconds), microbatches re-run and
dropped, iterations redone (restart). Everything runs on this machine: the
numbers compare the three runs of one session, not absolute speeds.

  benchmarks/runtime/elastic_churn.py [--build build] [--iterations 60] ...
"""
import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_daemons import ROOT, LocalCluster, benchmark_parser, parse_benchmark_args  # noqa: E402,E501



class Cluster(LocalCluster):
    """The emulated geo cluster: a coordinator with --cluster and --emulate_network,
    workers named w0, w1, ... in the cluster's regions."""

    def __init__(self, args, name):
        super().__init__(args.build, f"detour-churn-{name}-",
                         [f"--cluster={args.cluster}", "--emulate_network"])
        self.regions = [n["region"] for n in json.load(open(args.cluster))["nodes"]]
        self.next_worker = 0

    def start_worker(self, region):
        wid = f"w{self.next_worker}"
        self.next_worker += 1
        return super().start_worker(wid, region)


def job_spec(args, elastic):
    return {
        "name": "churn", "model": {"preset": "tiny"},
        "pipeline": {"num_stages": 6, "data_nodes": 2, "replicas_per_stage": 2,
                     "microbatches_per_data_node": 6, "samples_per_microbatch": 2,
                     "skip_ratio": 0.33, "max_jump": 3, "memory_slots": 3},
        "optimizer": {"adamw": {"lr": 1e-3}},
        "iterations": args.iterations, "seed": 3,
        "checkpoint": {"every_iterations": args.checkpoint_every, "keep_last": 2},
        "elastic": {"disabled": not elastic, "reconnect_grace_ms": 1000},
    }


def field(d, *names, default=0):
    for n in names:
        if n in d:
            return d[n]
    return default


def run(args, mode):
    c = Cluster(args, mode)
    try:
        for r in c.regions:
            c.start_worker(r)
        spec_path = os.path.join(c.dir, "job.json")
        json.dump(job_spec(args, elastic=(mode != "restart")), open(spec_path, "w"))
        job = c.ctl("submit", spec_path)
        jid = job["id"]
        rng = random.Random(args.seed)
        start = None
        kills, redone, next_kill = 0, 0, args.kill_every
        while True:
            j = c.ctl("get", jid)
            state = j.get("state", "")
            it = int(field(j.get("progress", {}), "iteration"))
            if start is None and state == "JOB_STATE_RUNNING":
                start = time.time()
            if state == "JOB_STATE_SUCCEEDED":
                break
            if state == "JOB_STATE_FAILED" and mode != "restart":
                raise RuntimeError(f"{mode}: job failed: {j.get('message')}")
            if mode == "restart" and state == "JOB_STATE_FAILED":
                ckpt = j.get("lastCheckpoint", j.get("last_checkpoint", ""))
                done = int(ckpt.rsplit("iter-", 1)[1]) if "iter-" in ckpt else 0
                redone += it - done
                if done > 0:
                    c.ctl("resume", jid)
                else:  # killed before the first checkpoint: start over
                    jid = c.ctl("submit", spec_path)["id"]
                continue
            if mode != "none" and state == "JOB_STATE_RUNNING" and it >= next_kill and \
                    it < args.iterations - 2:
                members = [n for s in j.get("stages", []) for n in s.get("nodes", [])]
                victim = rng.choice(members)
                region = c.regions[int(victim[1:]) % len(c.regions)]
                c.procs[victim].send_signal(signal.SIGKILL)
                kills += 1
                next_kill += args.kill_every
                c.start_worker(region)
            time.sleep(0.2)
        wall = time.time() - start
        p = j.get("progress", {})
        context = int(field(j.get("spec", {}).get("model", {}), "contextLength",
                            "context_length", default=128))
        tokens = args.iterations * 2 * 6 * 2 * context  # microbatches x samples x context
        return {
            "mode": mode, "wall_s": wall, "tokens_per_s": tokens / wall, "kills": kills,
            "recoveries": int(field(p, "recoveries")),
            "rerun": int(field(p, "microbatchesRerun", "microbatches_rerun")),
            "dropped": int(field(p, "microbatchesDropped", "microbatches_dropped")),
            "redone_iterations": redone,
            "recovery_mean_s": (c.metric("detour_coordinator_recovery_seconds_sum") /
                                max(1.0, c.metric("detour_coordinator_recovery_seconds_count"))),
            "loss": float(field(p, "loss")),
        }
    finally:
        c.stop()


def main():
    ap = benchmark_parser(__doc__, 60, ("none", "elastic", "restart"))
    ap.add_argument("--cluster", default=os.path.join(ROOT, "examples/clusters/geo12.json"),
                    help="cluster file whose regions and links are emulated (default: %(default)s)")
    ap.add_argument("--kill-every", type=int, default=10,
                    help="kill a worker of the job every N iterations (default: %(default)s)")
    ap.add_argument("--checkpoint-every", type=int, default=5,
                    help="checkpoint interval; what the restart run resumes from "
                         "(default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1,
                    help="seed of the choice of victims (default: %(default)s)")
    args = parse_benchmark_args(ap)
    if args.kill_every < 1 or args.checkpoint_every < 1:
        ap.error("--kill-every and --checkpoint-every must be at least 1")
    results = []
    for mode in args.modes.split(","):
        print(f"== {mode}", file=sys.stderr, flush=True)
        results.append(run(args, mode))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    base = next((r for r in results if r["mode"] == "none"), results[0])
    print(f"{'run':8} {'wall s':>8} {'tok/s':>8} {'vs none':>8} {'kills':>5} {'recov':>5} "
          f"{'mean rec s':>10} {'rerun':>5} {'dropped':>7} {'redone it':>9} {'Mtok/h':>7}")
    for r in results:
        print(f"{r['mode']:8} {r['wall_s']:8.1f} {r['tokens_per_s']:8.0f} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:8.2f} {r['kills']:5d} "
              f"{r['recoveries']:5d} {r['recovery_mean_s']:10.2f} {r['rerun']:5d} "
              f"{r['dropped']:7d} {r['redone_iterations']:9d} "
              f"{r['tokens_per_s'] * 3600 / 1e6:7.2f}")


if __name__ == "__main__":
    main()
