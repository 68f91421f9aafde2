#!/usr/bin/env python3
"""Turns a job's measured link matrix into a ClusterSpec for detour-sim.

Usage: benchmarks/wan/links_to_cluster.py CLUSTER.json LINKS.json OUT.json

CLUSTER.json is the spec detour-local ran (its nodes, in order: worker w<i+1>
ran node i, as detour-local starts them); LINKS.json is what GetLinks showed
(detour-local writes the matrix the job's first plan was made on to
--out/links.json). The output keeps the nodes (ids, speeds) but gives each
one a region of its own, named after the node, so that every pair of nodes
has its own RegionLink: one-way latency and bandwidth as the planner had
them (measured by the start's link probes, or the region table's where a
probe did not answer). A RegionLink has no direction, so the two directions
of a pair are averaged (latency) and the slower one kept (bandwidth: a
transfer either way must fit). Pairs the matrix lacks (nodes that were not
members of the job) keep the cluster's own figures for their regions, and
are counted on stderr.
"""
import json
import sys


def fail(message):
    print("links_to_cluster: " + message, file=sys.stderr)
    sys.exit(2)


def load(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail("%s %s: %s" % (what, path, e))


def main():
    if len(sys.argv) != 4:
        fail("usage: links_to_cluster.py CLUSTER.json LINKS.json OUT.json")
    cluster = load(sys.argv[1], "cluster")
    links = load(sys.argv[2], "links")
    nodes = cluster.get("nodes") or []
    if len(nodes) < 2:
        fail("%s: needs at least two nodes" % sys.argv[1])
    worker_node = {"w%d" % (i + 1): i for i in range(len(nodes))}
    pairs = {}
    for l in links.get("links", []):
        a, b = worker_node.get(l.get("from")), worker_node.get(l.get("to"))
        if a is None or b is None:
            fail("link %s -> %s: a worker the cluster has no node for" % (l.get("from"), l.get("to")))
        latency = float(l.get("latency_seconds", 0))
        rate = float(l.get("bandwidth_bytes_per_s", 0))
        if not latency >= 0 or not rate > 0:
            fail("link %s -> %s: latency %r s, bandwidth %r B/s" %
                 (l["from"], l["to"], latency, rate))
        pairs.setdefault((min(a, b), max(a, b)), []).append((latency, rate))
    table = {}
    for l in cluster.get("links", []):
        table[(l["region_a"], l["region_b"])] = table[(l["region_b"], l["region_a"])] = l
    intra = {"latency_ms": cluster.get("intra_region_latency_ms", 1.0),
             "bandwidth_gbytes_per_s": cluster.get("intra_region_bandwidth_gbytes_per_s", 5.0)}
    out_links = []
    unmeasured = 0
    for i in range(len(nodes)):
        for j in range(i + 1, len(nodes)):
            seen = pairs.get((i, j))
            if not seen:
                ra, rb = nodes[i].get("region", ""), nodes[j].get("region", "")
                known = intra if ra == rb else table.get((ra, rb))
                if known is None:
                    fail("no link between w%d and w%d in %s, nor between their regions %r and %r "
                         "in %s" % (i + 1, j + 1, sys.argv[2], ra, rb, sys.argv[1]))
                unmeasured += 1
                seen = [(known["latency_ms"] / 1e3, known["bandwidth_gbytes_per_s"] * 1e9)]
            out_links.append({
                "region_a": "n%d" % i,
                "region_b": "n%d" % j,
                "latency_ms": 1e3 * sum(x[0] for x in seen) / len(seen),
                "bandwidth_gbytes_per_s": min(x[1] for x in seen) / 1e9,
            })
    out = dict(cluster)
    out["name"] = cluster.get("name", "cluster") + "-measured"
    out["nodes"] = [dict(n, region="n%d" % i) for i, n in enumerate(nodes)]
    out["links"] = out_links
    with open(sys.argv[3], "w") as f:
        json.dump(out, f, indent=1)
    if unmeasured:
        print("links_to_cluster: %d of %d node pairs not in the matrix: the cluster's figures"
              % (unmeasured, len(out_links)), file=sys.stderr)


if __name__ == "__main__":
    main()
