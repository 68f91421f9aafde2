# shellcheck shell=bash
# The four-worker set-up that benchmarks/wan/link_probe.sh and
# benchmarks/wan/running_probes.sh share (sourced, not run): two regions of
# two workers each (like examples/clusters/wan2.json), and a short job of the
# tiny model whose 2 stages, 2 data nodes and 2 replicas use all four.

# two_regions_cluster NAME ONE_WAY_MS RATE_MBYTES_PER_S FILE: the ClusterSpec,
# with the case's latency and rate between the regions and 1 ms, 50 MB/s
# within each.
two_regions_cluster() {
  cat >"$4" <<JSON
{ "name": "$1",
  "nodes": [ { "id": "e0", "region": "East" }, { "id": "e1", "region": "East" },
             { "id": "w0", "region": "West" }, { "id": "w1", "region": "West" } ],
  "links": [ { "region_a": "East", "region_b": "West", "latency_ms": $2,
               "bandwidth_gbytes_per_s": $(awk -v r="$3" 'BEGIN { print r / 1000 }') } ],
  "intra_region_latency_ms": 1.0, "intra_region_bandwidth_gbytes_per_s": 0.05 }
JSON
}

# two_regions_job NAME ITERATIONS FILE: the JobSpec.
two_regions_job() {
  cat >"$3" <<JSON
{ "name": "$1", "model": { "preset": "tiny" },
  "pipeline": { "num_stages": 2, "data_nodes": 2, "replicas_per_stage": 2,
    "microbatches_per_data_node": 2, "samples_per_microbatch": 2, "memory_slots": 2 },
  "optimizer": { "adamw": { "lr": 1e-3 } },
  "data": { "source": "DATA_SOURCE_EMBEDDED" },
  "iterations": $2, "checkpoint": { "disabled": true }, "seed": 5, "device": "cpu" }
JSON
}
