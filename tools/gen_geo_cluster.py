#!/usr/bin/env python3
"""Builds a ClusterSpec JSON from a region latency/bandwidth CSV.

Usage: tools/gen_geo_cluster.py REGIONS.csv NODES [--exclude R,R] [--name N] > spec.json

Nodes are spread round-robin over the regions (sorted by the CSV's first
appearance), named w0..w{N-1}. Every CSV row becomes a RegionLink, so the spec
carries the whole table; regions missing a pair with another used region are
reported and must be excluded (the shipped CSV lacks Ireland-Sofia and
Ireland-Amsterdam).
"""
import argparse, csv, json, sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("nodes", type=int)
    ap.add_argument("--exclude", default="", help="comma-separated regions to leave out")
    ap.add_argument("--name", default="geo")
    args = ap.parse_args()
    excluded = {r for r in args.exclude.split(",") if r}
    links, regions = [], []
    with open(args.csv) as f:
        for row in csv.DictReader(f):
            a, b = row["region_a"], row["region_b"]
            for r in (a, b):
                if r not in regions:
                    regions.append(r)
            links.append({"region_a": a, "region_b": b,
                          "latency_ms": float(row["latency_ms"]),
                          "bandwidth_gbytes_per_s": float(row["bandwidth_gbytes_per_s"])})
    used = [r for r in regions if r not in excluded]
    pairs = {frozenset((l["region_a"], l["region_b"])) for l in links}
    missing = [(a, b) for i, a in enumerate(used) for b in used[i + 1:]
               if frozenset((a, b)) not in pairs]
    if missing:
        sys.exit("missing region pairs (exclude a region): " +
                 ", ".join(f"{a}-{b}" for a, b in missing))
    nodes = [{"id": f"w{i}", "region": used[i % len(used)], "speed": 1.0}
             for i in range(args.nodes)]
    links = [l for l in links if l["region_a"] in used and l["region_b"] in used]
    spec = {"name": args.name, "nodes": nodes, "links": links,
            "intra_region_latency_ms": 1.0,
            "intra_region_bandwidth_gbytes_per_s": 5.0}
    json.dump(spec, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
