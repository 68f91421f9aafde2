#!/usr/bin/env python3
"""Schema check of detour's Kubernetes manifests (deploy/k8s/*.yaml).

Checks what a typo in a manifest would break at deploy time: kinds and API
versions, required fields, selectors matching pod labels, every referenced
Secret / ConfigMap / PersistentVolumeClaim / Service / port name / volume
existing, every file path under a Secret mount naming a key of that Secret,
$(VAR) references defined, resource requests (a GPU for workers), Prometheus
annotations matching the metrics port, and container args and probe commands
using only flags the binaries declare (read from their --help).

  k8s_check.py --manifests deploy/k8s --bin_dir build
  k8s_check.py ... --self_test   # also proves each check catches a broken copy

Exit status 0 when clean, 1 with one line per problem.
"""
import argparse
import copy
import glob
import os
import re
import shlex
import subprocess
import sys

import yaml

API_VERSIONS = {
    "Namespace": "v1", "Secret": "v1", "ConfigMap": "v1", "Service": "v1",
    "PersistentVolumeClaim": "v1", "StatefulSet": "apps/v1", "Deployment": "apps/v1",
    "DaemonSet": "apps/v1",
}
WORKLOADS = ("StatefulSet", "Deployment", "DaemonSet")
# Binary -> path under the build tree.
BINARIES = {
    "detour-coordinator": "coordinator/detour-coordinator",
    "detour-worker": "worker/detour-worker",
    "detourctl": "tools/detourctl/detourctl",
}


def flags_of(bin_dir, binary, subcommand=None):
    argv = [os.path.join(bin_dir, BINARIES[binary])]
    if subcommand:
        argv.append(subcommand)
    out = subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=30).stdout
    return set(re.findall(r"^  --([a-z0-9_-]+)", out, re.M))


class Checker:
    def __init__(self, docs, flag_lookup):
        self.docs = docs
        self.flag_lookup = flag_lookup
        self.problems = []

    def bad(self, where, message):
        self.problems.append(f"{where}: {message}")

    def named(self, kind):
        return {d["metadata"]["name"]: d for d in self.docs
                if d.get("kind") == kind and isinstance(d.get("metadata"), dict)}

    def run(self):
        namespaces = set(self.named("Namespace"))
        for d in self.docs:
            self.check_basics(d, namespaces)
        if self.problems:
            return self.problems
        for d in self.docs:
            if d["kind"] in WORKLOADS:
                self.check_workload(d)
            elif d["kind"] == "Service":
                self.check_service(d)
        return self.problems

    def check_basics(self, d, namespaces):
        kind = d.get("kind")
        where = f"{kind}/{(d.get('metadata') or {}).get('name', '?')}"
        if kind not in API_VERSIONS:
            self.bad(where, f"unknown kind {kind!r} (known: {', '.join(sorted(API_VERSIONS))})")
            return
        if d.get("apiVersion") != API_VERSIONS[kind]:
            self.bad(where, f"apiVersion {d.get('apiVersion')!r}, expected {API_VERSIONS[kind]!r}")
        meta = d.get("metadata")
        if not isinstance(meta, dict) or not meta.get("name"):
            self.bad(where, "metadata.name missing")
            return
        if kind != "Namespace":
            ns = meta.get("namespace")
            if ns not in namespaces:
                self.bad(where, f"metadata.namespace {ns!r} is not a Namespace in the manifests")
        if kind in WORKLOADS or kind in ("Service", "PersistentVolumeClaim"):
            if not isinstance(d.get("spec"), dict):
                self.bad(where, "spec missing")

    def check_service(self, svc):
        where = f"Service/{svc['metadata']['name']}"
        selector = svc["spec"].get("selector") or {}
        pods = [w for w in self.docs if w["kind"] in WORKLOADS and
                selector.items() <= (w["spec"]["template"]["metadata"].get("labels") or {}).items()]
        if not pods:
            self.bad(where, f"selector {selector} matches no workload's pod labels")
            return
        port_names = {p.get("name") for w in pods for c in w["spec"]["template"]["spec"]["containers"]
                      for p in c.get("ports", [])}
        for port in svc["spec"].get("ports", []):
            for key in ("name", "port"):
                if key not in port:
                    self.bad(where, f"a port without {key}")
            target = port.get("targetPort")
            if isinstance(target, str) and target not in port_names:
                self.bad(where, f"targetPort {target!r} is not a container port name "
                                f"(have {sorted(n for n in port_names if n)})")

    def check_workload(self, w):
        name = w["metadata"]["name"]
        where = f"{w['kind']}/{name}"
        spec = w["spec"]
        template = spec.get("template") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        match = (spec.get("selector") or {}).get("matchLabels") or {}
        if not match or not match.items() <= labels.items():
            self.bad(where, f"selector.matchLabels {match} not among the pod labels {labels}")
        if w["kind"] == "StatefulSet":
            if spec.get("serviceName") not in self.named("Service"):
                self.bad(where, f"serviceName {spec.get('serviceName')!r} is not a Service")
        pod = template.get("spec") or {}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for claim in spec.get("volumeClaimTemplates", []):
            volumes[claim["metadata"]["name"]] = {"name": claim["metadata"]["name"], "claim": True}
        secrets, configmaps, pvcs = self.named("Secret"), self.named("ConfigMap"), \
            self.named("PersistentVolumeClaim")
        for v in volumes.values():
            if "secret" in v and v["secret"].get("secretName") not in secrets:
                self.bad(where, f"volume {v['name']}: Secret {v['secret'].get('secretName')!r} "
                                "is not in the manifests")
            if "configMap" in v and v["configMap"].get("name") not in configmaps:
                self.bad(where, f"volume {v['name']}: ConfigMap {v['configMap'].get('name')!r} "
                                "is not in the manifests")
            if "persistentVolumeClaim" in v and \
                    v["persistentVolumeClaim"].get("claimName") not in pvcs:
                self.bad(where, f"volume {v['name']}: PersistentVolumeClaim "
                                f"{v['persistentVolumeClaim'].get('claimName')!r} is not in the manifests")
        containers = pod.get("containers") or []
        if not containers:
            self.bad(where, "no containers")
        annotations = (template.get("metadata") or {}).get("annotations") or {}
        for c in containers:
            self.check_container(where, name, spec, c, volumes, secrets, annotations)

    def check_container(self, where, name, spec, c, volumes, secrets, annotations):
        where = f"{where} container {c.get('name', '?')}"
        for key in ("name", "image"):
            if not c.get(key):
                self.bad(where, f"{key} missing")
        ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
        env = {e["name"] for e in c.get("env", [])}
        mounts = {}
        for m in c.get("volumeMounts", []):
            if m.get("name") not in volumes:
                self.bad(where, f"volumeMount {m.get('name')!r} is not a volume or claim template")
            else:
                mounts[m["mountPath"].rstrip("/")] = volumes[m["name"]]
        args = c.get("args") or c.get("command") or []
        if not args or args[0] not in BINARIES:
            self.bad(where, f"args[0] {args[:1]} is not one of {sorted(BINARIES)}")
            return
        binary = args[0]
        # Pod names a $(POD_NAME) stands for: StatefulSet ordinal 0 is enough
        # to check the files exist in the example Secret.
        pod_name = f"{name}-0"
        self.check_flags(where, binary, None, args[1:])
        for arg in args[1:]:
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                if var not in env:
                    self.bad(where, f"{arg}: $({var}) is not in the container's env")
            value = arg.split("=", 1)[1] if "=" in arg else ""
            self.check_secret_path(where, value.replace("$(POD_NAME)", pod_name), mounts, secrets)
        for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.get(probe_name)
            if probe is None:
                continue
            self.check_probe(f"{where} {probe_name}", probe, ports, mounts, secrets, pod_name)
        if "readinessProbe" not in c or "livenessProbe" not in c:
            self.bad(where, "needs both a readinessProbe and a livenessProbe")
        requests = (c.get("resources") or {}).get("requests") or {}
        if "cpu" not in requests or "memory" not in requests:
            self.bad(where, "resources.requests needs cpu and memory")
        if binary == "detour-worker":
            limits = (c.get("resources") or {}).get("limits") or {}
            if "nvidia.com/gpu" not in limits:
                self.bad(where, "a worker needs resources.limits nvidia.com/gpu")
        if annotations.get("prometheus.io/scrape") == "true":
            port = annotations.get("prometheus.io/port")
            if "metrics" not in ports or str(ports["metrics"]) != str(port):
                self.bad(where, f"prometheus.io/port {port!r} is not the container port "
                                f"'metrics' ({ports.get('metrics')})")
            flag = [a for a in args if a.startswith("--metrics_port=")]
            if flag and flag[0].split("=", 1)[1] != str(port):
                self.bad(where, f"{flag[0]} differs from prometheus.io/port {port!r}")

    def check_flags(self, where, binary, subcommand, args):
        known = self.flag_lookup(binary, subcommand)
        for arg in args:
            if not arg.startswith("--"):
                continue
            flag = arg[2:].split("=", 1)[0]
            if flag in known:
                continue
            self.bad(where, f"{binary}{' ' + subcommand if subcommand else ''} has no flag --{flag}")

    def check_secret_path(self, where, path, mounts, secrets):
        for mount_path, volume in mounts.items():
            if not path.startswith(mount_path + "/") or "secret" not in volume:
                continue
            key = path[len(mount_path) + 1:]
            secret = secrets.get(volume["secret"].get("secretName"))
            data = dict((secret or {}).get("data") or {}, **((secret or {}).get("stringData") or {}))
            if secret is not None and key not in data:
                self.bad(where, f"{path}: Secret {volume['secret']['secretName']!r} has no key {key!r}")

    def check_probe(self, where, probe, ports, mounts, secrets, pod_name):
        if "grpc" in probe or "httpGet" in probe or "tcpSocket" in probe:
            kind = next(k for k in ("grpc", "httpGet", "tcpSocket") if k in probe)
            port = probe[kind].get("port")
            if isinstance(port, str) and port not in ports:
                self.bad(where, f"{kind} port {port!r} is not a container port name")
            if isinstance(port, int) and port not in ports.values():
                self.bad(where, f"{kind} port {port} is not a container port")
            return
        command = (probe.get("exec") or {}).get("command")
        if not command:
            self.bad(where, "no grpc, httpGet, tcpSocket or exec command")
            return
        if command[:2] == ["sh", "-c"]:
            command = shlex.split(command[2].replace("$POD_NAME", pod_name))
            if command and command[0] == "exec":
                command = command[1:]
        if not command or command[0] != "detourctl" or len(command) < 2:
            self.bad(where, f"exec probe {command[:2]} is not a detourctl command")
            return
        self.check_flags(where, "detourctl", command[1], command[2:])
        for arg in command[2:]:
            value = arg.split("=", 1)[1] if "=" in arg else ""
            self.check_secret_path(where, value.replace("$(POD_NAME)", pod_name), mounts, secrets)


def load(manifests):
    docs = []
    for path in sorted(glob.glob(os.path.join(manifests, "*.yaml"))):
        with open(path) as f:
            for d in yaml.safe_load_all(f):
                if d is not None:
                    docs.append(d)
    return docs


def mutate(docs, kind, name, edit):
    out = copy.deepcopy(docs)
    for d in out:
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            edit(d)
    return out


def self_test(docs, lookup):
    """Each broken copy must be refused with the expected words."""
    def container(d):
        return d["spec"]["template"]["spec"]["containers"][0]
    cases = [
        ("Secret renamed", mutate(docs, "Secret", "detour-tls",
                                  lambda d: d["metadata"].update(name="other")), "is not in the manifests"),
        ("unknown flag", mutate(docs, "StatefulSet", "detour-worker",
                                lambda d: container(d)["args"].append("--gpu_count=8")), "no flag --gpu_count"),
        ("probe port", mutate(docs, "StatefulSet", "detour-coordinator",
                              lambda d: container(d)["livenessProbe"]["httpGet"].update(port="http")),
         "'http' is not a container port name"),
        ("service target", mutate(docs, "Service", "detour-worker",
                                  lambda d: d["spec"]["ports"][0].update(targetPort="rpc")), "targetPort 'rpc'"),
        ("secret key", mutate(docs, "StatefulSet", "detour-coordinator",
                              lambda d: container(d)["args"].append("--tls_ca=/etc/detour/tls/root.crt")),
         "has no key 'root.crt'"),
        ("no gpu", mutate(docs, "StatefulSet", "detour-worker",
                          lambda d: container(d)["resources"]["limits"].pop("nvidia.com/gpu")), "nvidia.com/gpu"),
        ("kind", mutate(docs, "Service", "detour-worker", lambda d: d.update(apiVersion="v2")), "apiVersion"),
        ("selector", mutate(docs, "StatefulSet", "detour-worker",
                            lambda d: d["spec"]["selector"]["matchLabels"].update(x="y")), "matchLabels"),
        ("env", mutate(docs, "StatefulSet", "detour-worker",
                       lambda d: container(d)["env"].pop(0)), "$(POD_NAME) is not in the container's env"),
        ("scrape port", mutate(docs, "StatefulSet", "detour-worker",
                               lambda d: d["spec"]["template"]["metadata"]["annotations"].update(
                                   {"prometheus.io/port": "9999"})), "prometheus.io/port '9999'"),
    ]
    failed = []
    for label, broken, expect in cases:
        problems = Checker(broken, lookup).run()
        if not any(expect in p for p in problems):
            failed.append(f"self-test {label}: expected a problem with {expect!r}, got {problems}")
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifests", required=True)
    parser.add_argument("--bin_dir", required=True, help="build tree holding the binaries")
    parser.add_argument("--self_test", action="store_true")
    a = parser.parse_args()
    cache = {}

    def lookup(binary, subcommand):
        key = (binary, subcommand)
        if key not in cache:
            cache[key] = flags_of(a.bin_dir, binary, subcommand)
        return cache[key]

    docs = load(a.manifests)
    if not docs:
        print(f"k8s_check: no manifests under {a.manifests}")
        return 1
    checker = Checker(docs, lookup)
    problems = checker.run()
    if a.self_test:
        problems += self_test(docs, lookup)
    for p in problems:
        print(f"k8s_check: {p}")
    kinds = sorted({f"{d['kind']}/{d['metadata']['name']}" for d in docs})
    print(f"k8s_check: {len(docs)} objects ({', '.join(kinds)}): "
          f"{'OK' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
