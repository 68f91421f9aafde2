#!/usr/bin/env python3
"""Checks deploy/grafana/detour-dashboard.json offline: valid JSON in the
shape Grafana imports (unique panel ids, grid positions, a Prometheus
datasource variable, queries with refIds), and every metric a query names is
documented in docs/METRICS.md or recorded by deploy/prometheus/detour.rules.yml.
That the queries parse and return data against a live cluster is checked by
the e2e test ObservabilityTest.

Usage: grafana_check.py DASHBOARD RULES METRICS_MD
"""
import json
import re
import sys

METRIC = re.compile(r"\b((?:detour|process)_[a-z0-9_]+|detour:[a-z0-9_:]+)\b")
SUFFIXES = ("_bucket", "_sum", "_count")


def fail(message):
    print(f"grafana_check: {message}", file=sys.stderr)
    sys.exit(1)


def documented_families(metrics_md):
    names = set(re.findall(r"^\|\s*`([a-z_:][a-z0-9_:]*)`", open(metrics_md).read(), re.M))
    if len(names) < 20:
        fail(f"{metrics_md}: found only {len(names)} documented metrics; table format changed?")
    return names


def recorded(rules):
    return set(re.findall(r"^\s*-\s*record:\s*(\S+)", open(rules).read(), re.M))


def known(name, families, records):
    if name in families or name in records:
        return True
    return any(name.endswith(s) and name[: -len(s)] in families for s in SUFFIXES)


def main():
    if len(sys.argv) != 4:
        fail(__doc__)
    dashboard_path, rules, metrics_md = sys.argv[1:]
    try:
        dashboard = json.load(open(dashboard_path))
    except (OSError, ValueError) as e:
        fail(f"{dashboard_path}: {e}")
    families, records = documented_families(metrics_md), recorded(rules)
    for key in ("title", "uid", "panels", "templating", "schemaVersion"):
        if key not in dashboard:
            fail(f"dashboard has no {key!r}")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    if variables.get("datasource", {}).get("query") != "prometheus":
        fail("no datasource variable of type prometheus")
    ids, queries = set(), 0
    for panel in dashboard["panels"]:
        title = panel.get("title", "?")
        if panel.get("id") in ids:
            fail(f"panel {title!r}: duplicate id {panel.get('id')}")
        ids.add(panel.get("id"))
        grid = panel.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in ("x", "y", "w", "h")) or \
                grid["x"] + grid["w"] > 24:
            fail(f"panel {title!r}: bad gridPos {grid}")
        if panel.get("type") == "row":
            continue
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            fail(f"panel {title!r}: datasource is not the ${{datasource}} variable")
        targets = panel.get("targets") or fail(f"panel {title!r}: no queries")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or None in refs:
            fail(f"panel {title!r}: refIds {refs} are not unique")
        for t in targets:
            expr = t.get("expr") or fail(f"panel {title!r}: query {t.get('refId')} has no expr")
            queries += 1
            for name in METRIC.findall(expr):
                if not known(name, families, records):
                    fail(f"panel {title!r}: {name} is neither in METRICS.md nor a recording rule")
            for var in re.findall(r"\$(\w+)", expr):
                if var not in variables and not var.startswith("__"):
                    fail(f"panel {title!r}: ${var} is not a dashboard variable")
    print(f"grafana_check: {len(ids)} panels, {queries} queries OK")


if __name__ == "__main__":
    main()
