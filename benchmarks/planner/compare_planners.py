#!/usr/bin/env python3
"""Compares two detour-sim binaries (e.g. the planner before and after a change)
on random geo-distributed clusters: `detour-sim compare --json` for each case,
the skippipe plan's pipeline and iteration time from each binary, the ratio
new/old, and whether skippipe <= skip-no-collision <= random held.

  benchmarks/planner/compare_planners.py OLD_DETOUR_SIM NEW_DETOUR_SIM [--cases N] [--seed S]

Clusters: 8-30 nodes dealt over a random subset of the 11 regions (and
links) of examples/clusters/geo20.json, speeds in [0.75, 1.25]; jobs: the
1.5B shape with 3-8 stages, 1-5 data nodes, 1-4 replicas, 2-8 microbatches
per data node, skip 0.25/0.33/0.5, max jump 2-4, 0-2 swaps, 2-3 memory slots.
Both binaries plan with the job's default objective (the iteration).
Only fields both binaries know are written. Prints a markdown table and a
summary line.
"""
import argparse, json, os, random, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_case(rng, base):
    regions = sorted({n["region"] for n in base["nodes"]})
    used = rng.sample(regions, rng.randint(2, len(regions)))
    while True:
        stages = rng.randint(3, 8)
        data = rng.randint(1, 5)
        replicas = rng.randint(1, 4)
        needed = data + (stages - 1) * replicas
        if needed <= 30:
            break
    nodes = max(8, needed + rng.randint(0, 3))
    cluster = {
        "name": "random",
        "nodes": [{"id": f"n{i}", "region": used[i % len(used)],
                   "speed": round(0.75 + 0.5 * rng.random(), 3)} for i in range(nodes)],
        "links": [l for l in base["links"] if l["region_a"] in used and l["region_b"] in used],
    }
    skip = rng.choice([0.25, 0.33, 0.5])
    job = {
        "name": "random",
        "model": {"preset": "1.5b"},
        "pipeline": {
            "num_stages": stages, "data_nodes": data, "replicas_per_stage": replicas,
            "microbatches_per_data_node": rng.randint(2, 8), "samples_per_microbatch": 2,
            "skip_ratio": skip, "max_jump": rng.randint(2, 4), "max_swaps": rng.randint(0, 2),
            "max_swap_distance": 1, "max_total_swap_distance": 2,
            "memory_slots": rng.randint(2, 3),
        },
        "iterations": 1, "seed": rng.randint(0, 1000),
    }
    return cluster, job


def compare(binary, cluster_path, job_path):
    out = subprocess.run([binary, "compare", "--cluster", cluster_path, "--job", job_path, "--json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None, out.stderr.strip().splitlines()[-1] if out.stderr else "failed"
    r = {s["scheduler"]: s for s in json.loads(out.stdout)["schedulers"]}
    return r, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--cases", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    base = json.load(open(os.path.join(ROOT, "examples/clusters/geo20.json")))
    rng = random.Random(args.seed)
    rows, ratios_p, ratios_i, order_ok, compared = [], [], [], 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for case in range(args.cases):
            cluster, job = make_case(rng, base)
            cp, jp = os.path.join(tmp, "c.json"), os.path.join(tmp, "j.json")
            json.dump(cluster, open(cp, "w"))
            json.dump(job, open(jp, "w"))
            old, err_old = compare(args.old, cp, jp)
            new, err_new = compare(args.new, cp, jp)
            p = job["pipeline"]
            shape = (f'{len(cluster["nodes"])} nodes, S={p["num_stages"]} D={p["data_nodes"]} '
                     f'R={p["replicas_per_stage"]} M={p["microbatches_per_data_node"]} '
                     f'skip {p["skip_ratio"]} jump {p["max_jump"]} swaps {p["max_swaps"]}')
            if old is None or new is None:
                rows.append(f"| {case} | {shape} | {err_old or '-'} | {err_new or '-'} | | | |")
                continue
            compared += 1
            o, n = old["skippipe"], new["skippipe"]
            rp = n["pipeline_time_s"] / o["pipeline_time_s"]
            ri = n["iteration_time_s"] / o["iteration_time_s"]
            ratios_p.append(rp)
            ratios_i.append(ri)
            # By the default objective (the iteration).
            ok = (n["iteration_time_s"] <= new["skip-no-collision"]["iteration_time_s"] + 1e-9 and
                  n["iteration_time_s"] <= new["random"]["iteration_time_s"] + 1e-9)
            order_ok += ok
            rows.append(f'| {case} | {shape} | {o["pipeline_time_s"]:.2f} / {o["iteration_time_s"]:.2f} '
                        f'| {n["pipeline_time_s"]:.2f} / {n["iteration_time_s"]:.2f} | {rp:.3f} | {ri:.3f} '
                        f'| {"yes" if ok else "no"} |')
    print("| case | shape | old skippipe pipeline / iteration s | new | pipeline new/old | iteration new/old | new skippipe iteration <= snc, random |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if ratios_p:
        import statistics
        print(f"\n{compared} cases compared: iteration new/old median {statistics.median(ratios_i):.3f} "
              f"(min {min(ratios_i):.3f}, max {max(ratios_i):.3f}), pipeline new/old median "
              f"{statistics.median(ratios_p):.3f} (min {min(ratios_p):.3f}, max {max(ratios_p):.3f}); "
              f"new skippipe iteration <= skip-no-collision's and random's in {order_ok} of {compared}")


if __name__ == "__main__":
    sys.exit(main())
