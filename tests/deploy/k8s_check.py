#!/usr/bin/env python3
"""Schema check of detour's Kubernetes manifests (deploy/k8s).

Renders every overlay (deploy/k8s/overlays/**/kustomization.yaml) with
`kubectl kustomize` and checks what a typo in a manifest would break at
deploy time: kinds and API versions, required fields, selectors matching pod
labels, every referenced Secret / ConfigMap / PersistentVolumeClaim /
Service / ServiceAccount / Issuer / port name / volume existing, every file
path under a Secret or cert-manager CSI mount naming a key it has, $(VAR)
references defined (in env values: defined earlier, as Kubernetes expands
them), pinned image tags, startup, readiness and liveness probes, a
PodDisruptionBudget and a NetworkPolicy for every workload, the workers'
region taken from the ConfigMap that also picks their nodes, --device
matching the GPU request and the image, etcd and coordinator addresses
naming pods that exist, Prometheus annotations matching the metrics port,
and container args and probe commands using only flags the binaries declare
(read from their --help). The Secrets an operator creates by hand are
declared in deploy/k8s/secrets.example.yaml.

  k8s_check.py --root deploy/k8s --bin_dir build [--self_test]

Exit status 0 when clean, 1 with one line per problem, 77 when kubectl is
missing (CTest: skipped).
"""
import argparse
import copy
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

import yaml

API_VERSIONS = {
    "Namespace": "v1", "Secret": "v1", "ConfigMap": "v1", "Service": "v1",
    "ServiceAccount": "v1", "PersistentVolumeClaim": "v1", "StatefulSet": "apps/v1",
    "Deployment": "apps/v1", "DaemonSet": "apps/v1", "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1", "Certificate": "cert-manager.io/v1",
    "Issuer": "cert-manager.io/v1",
}
WORKLOADS = ("StatefulSet", "Deployment", "DaemonSet")
# Binary -> path under the build tree.
BINARIES = {
    "detour-coordinator": "coordinator/detour-coordinator",
    "detour-worker": "worker/detour-worker",
    "detourctl": "tools/detourctl/detourctl",
}
# Programs of other projects the manifests run: flags not checked here.
EXTERNAL = {"etcd"}
# What cert-manager puts in a Certificate's Secret and in a CSI volume.
CERT_KEYS = {"tls.crt", "tls.key", "ca.crt"}
CSI_DRIVER = "csi.cert-manager.io"
REGION_LABEL = "topology.kubernetes.io/region"


def flags_of(bin_dir, binary, subcommand=None):
    argv = [os.path.join(bin_dir, BINARIES[binary])]
    if subcommand:
        argv.append(subcommand)
    out = subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=30).stdout
    return set(re.findall(r"^  --([a-z0-9_-]+)", out, re.M))


def labels_match(selector, labels):
    return bool(selector) and selector.items() <= (labels or {}).items()


class Checker:
    def __init__(self, docs, flag_lookup, given_secrets=()):
        self.docs = docs
        self.flag_lookup = flag_lookup
        self.given_secrets = list(given_secrets)
        self.problems = []

    def bad(self, where, message):
        self.problems.append(f"{where}: {message}")

    def named(self, kind):
        return {d["metadata"]["name"]: d for d in self.docs
                if d.get("kind") == kind and isinstance(d.get("metadata"), dict)}

    def secret_keys(self):
        """Secret name -> its keys: the manifests', the hand-made ones', cert-manager's."""
        keys = {}
        for s in list(self.named("Secret").values()) + self.given_secrets:
            keys[s["metadata"]["name"]] = set((s.get("data") or {})) | set((s.get("stringData") or {}))
        for c in self.named("Certificate").values():
            keys[(c.get("spec") or {}).get("secretName")] = set(CERT_KEYS)
        return keys

    def pods(self):
        return [w for w in self.docs if w["kind"] in WORKLOADS]

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
            elif d["kind"] == "Certificate":
                self.check_certificate(d)
            elif d["kind"] == "NetworkPolicy":
                self.check_network_policy(d)
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
        if kind not in ("Namespace", "Secret", "ConfigMap", "ServiceAccount"):
            if not isinstance(d.get("spec"), dict):
                self.bad(where, "spec missing")

    def check_service(self, svc):
        where = f"Service/{svc['metadata']['name']}"
        selector = svc["spec"].get("selector") or {}
        pods = [w for w in self.pods()
                if labels_match(selector, w["spec"]["template"]["metadata"].get("labels"))]
        pod_names = [w for w in self.pods()
                     if selector.get("statefulset.kubernetes.io/pod-name", "").rsplit("-", 1)[0]
                     == w["metadata"]["name"]]
        if not pods and not pod_names:
            self.bad(where, f"selector {selector} matches no workload's pod labels")
            return
        port_names = {p.get("name") for w in pods + pod_names
                      for c in w["spec"]["template"]["spec"]["containers"]
                      for p in c.get("ports", [])}
        for port in svc["spec"].get("ports", []):
            for key in ("name", "port"):
                if key not in port:
                    self.bad(where, f"a port without {key}")
            target = port.get("targetPort")
            if isinstance(target, str) and target not in port_names:
                self.bad(where, f"targetPort {target!r} is not a container port name "
                                f"(have {sorted(n for n in port_names if n)})")

    def check_certificate(self, cert):
        where = f"Certificate/{cert['metadata']['name']}"
        spec = cert["spec"]
        issuer = (spec.get("issuerRef") or {}).get("name")
        if issuer not in self.named("Issuer"):
            self.bad(where, f"issuerRef {issuer!r} is not an Issuer in the manifests")
        if not spec.get("secretName"):
            self.bad(where, "secretName missing")
        for uri in spec.get("uris", []):
            if uri.startswith("detour://") and \
                    not re.fullmatch(r"detour://(coordinator|client|worker)/[^/]+", uri):
                self.bad(where, f"{uri}: not an identity mark detour://KIND/NAME")

    def check_network_policy(self, policy):
        where = f"NetworkPolicy/{policy['metadata']['name']}"
        selector = (policy["spec"].get("podSelector") or {}).get("matchLabels") or {}
        pods = [w for w in self.pods()
                if selector.items() <= (w["spec"]["template"]["metadata"].get("labels") or {}).items()]
        port_names = {p.get("name") for w in pods for c in w["spec"]["template"]["spec"]["containers"]
                      for p in c.get("ports", [])}
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if isinstance(port.get("port"), str) and port["port"] not in port_names:
                    self.bad(where, f"port {port['port']!r} is not a port name of the pods it selects")

    def covered(self, kind, labels):
        return [d for d in self.docs if d["kind"] == kind and
                ((d["spec"].get("selector") if kind == "PodDisruptionBudget"
                  else d["spec"].get("podSelector")) or {}).get("matchLabels", {}).items()
                <= labels.items()]

    def check_workload(self, w):
        name = w["metadata"]["name"]
        where = f"{w['kind']}/{name}"
        spec = w["spec"]
        template = spec.get("template") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        match = (spec.get("selector") or {}).get("matchLabels") or {}
        if not labels_match(match, labels):
            self.bad(where, f"selector.matchLabels {match} not among the pod labels {labels}")
        if w["kind"] == "StatefulSet":
            if spec.get("serviceName") not in self.named("Service"):
                self.bad(where, f"serviceName {spec.get('serviceName')!r} is not a Service")
        pod = template.get("spec") or {}
        account = pod.get("serviceAccountName")
        if account not in self.named("ServiceAccount"):
            self.bad(where, f"serviceAccountName {account!r} is not a ServiceAccount in the manifests")
        if not [p for p in self.covered("PodDisruptionBudget", labels) if p["spec"].get("selector")]:
            self.bad(where, "no PodDisruptionBudget selects its pods")
        if not [p for p in self.covered("NetworkPolicy", labels)
                if (p["spec"].get("podSelector") or {}).get("matchLabels")]:
            self.bad(where, "no NetworkPolicy of its own selects its pods")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for claim in spec.get("volumeClaimTemplates", []):
            volumes[claim["metadata"]["name"]] = {"name": claim["metadata"]["name"], "claim": True}
        secrets, configmaps, pvcs = self.secret_keys(), self.named("ConfigMap"), \
            self.named("PersistentVolumeClaim")
        for v in volumes.values():
            if "secret" in v and v["secret"].get("secretName") not in secrets:
                self.bad(where, f"volume {v['name']}: Secret {v['secret'].get('secretName')!r} "
                                "is neither in the manifests, nor a Certificate's, nor in "
                                "secrets.example.yaml")
            if "configMap" in v and v["configMap"].get("name") not in configmaps:
                self.bad(where, f"volume {v['name']}: ConfigMap {v['configMap'].get('name')!r} "
                                "is not in the manifests")
            if "persistentVolumeClaim" in v and \
                    v["persistentVolumeClaim"].get("claimName") not in pvcs:
                self.bad(where, f"volume {v['name']}: PersistentVolumeClaim "
                                f"{v['persistentVolumeClaim'].get('claimName')!r} is not in the manifests")
            if "csi" in v:
                self.check_csi(where, v)
        containers = pod.get("containers") or []
        if not containers:
            self.bad(where, "no containers")
        annotations = (template.get("metadata") or {}).get("annotations") or {}
        for c in containers:
            self.check_container(where, w, c, volumes, secrets, annotations)

    def check_csi(self, where, v):
        csi = v["csi"]
        if csi.get("driver") != CSI_DRIVER:
            self.bad(where, f"volume {v['name']}: CSI driver {csi.get('driver')!r} is not {CSI_DRIVER}")
            return
        attrs = csi.get("volumeAttributes") or {}
        issuer = attrs.get("csi.cert-manager.io/issuer-name")
        if issuer not in self.named("Issuer"):
            self.bad(where, f"volume {v['name']}: issuer-name {issuer!r} is not an Issuer in the manifests")

    def env_of(self, where, c, configmaps):
        """Name -> value as far as it is known (a literal, or a ConfigMap's)."""
        env, known = {}, set()
        for e in c.get("env", []):
            value = e.get("value")
            if value is not None:
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value):
                    if var not in known:
                        self.bad(where, f"env {e['name']}: $({var}) is not defined before it "
                                        "(Kubernetes expands only earlier variables)")
            ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
            if ref:
                cm = configmaps.get(ref.get("name"))
                if cm is None or ref.get("key") not in (cm.get("data") or {}):
                    self.bad(where, f"env {e['name']}: ConfigMap {ref.get('name')!r} has no key "
                                    f"{ref.get('key')!r}")
                else:
                    value = cm["data"][ref["key"]]
            env[e["name"]] = (value, e)
            known.add(e["name"])
        return env

    def check_container(self, where, w, c, volumes, secrets, annotations):
        name = w["metadata"]["name"]
        pod = w["spec"]["template"]["spec"]
        where = f"{where} container {c.get('name', '?')}"
        for key in ("name", "image"):
            if not c.get(key):
                self.bad(where, f"{key} missing")
        image = c.get("image", "")
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        if not tag or tag == "latest":
            self.bad(where, f"image {image!r} is not pinned to a version tag")
        ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
        env = self.env_of(where, c, self.named("ConfigMap"))
        mounts = {}
        for m in c.get("volumeMounts", []):
            if m.get("name") not in volumes:
                self.bad(where, f"volumeMount {m.get('name')!r} is not a volume or claim template")
            else:
                mounts[m["mountPath"].rstrip("/")] = volumes[m["name"]]
        args = (c.get("command") or []) + (c.get("args") or [])
        if not args or (args[0] not in BINARIES and args[0] not in EXTERNAL):
            self.bad(where, f"program {args[:1]} is not one of {sorted(BINARIES) + sorted(EXTERNAL)}")
            return
        binary = args[0]
        # Pod names a $(POD_NAME) stands for: ordinal 0.
        pod_name = f"{name}-0"
        if binary in BINARIES:
            self.check_flags(where, binary, None, args[1:])
        for arg in args[1:]:
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                if var not in env:
                    self.bad(where, f"{arg}: $({var}) is not in the container's env")
            value = arg.split("=", 1)[1] if "=" in arg else ""
            self.check_file(where, value.replace("$(POD_NAME)", pod_name), mounts, secrets)
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(probe_name)
            if probe is None:
                self.bad(where, f"no {probe_name}")
                continue
            self.check_probe(f"{where} {probe_name}", probe, ports, mounts, secrets, pod_name)
        requests = (c.get("resources") or {}).get("requests") or {}
        if "cpu" not in requests or "memory" not in requests:
            self.bad(where, "resources.requests needs cpu and memory")
        flag = {a[2:].split("=", 1)[0]: a.split("=", 1)[1] for a in args[1:]
                if a.startswith("--") and "=" in a}
        if binary == "detour-worker":
            self.check_worker(where, pod, c, env, flag, tag)
        if binary == "detour-coordinator":
            self.check_coordinator(where, w, env, flag)
        if annotations.get("prometheus.io/scrape") == "true":
            port = annotations.get("prometheus.io/port")
            if "metrics" not in ports or str(ports["metrics"]) != str(port):
                self.bad(where, f"prometheus.io/port {port!r} is not the container port "
                                f"'metrics' ({ports.get('metrics')})")
            if flag.get("metrics_port", str(port)) != str(port):
                self.bad(where, f"--metrics_port={flag['metrics_port']} differs from "
                                f"prometheus.io/port {port!r}")

    def expand(self, value, env):
        """`value` with $(VAR)s replaced by what env knows (None when unknown)."""
        unknown = []

        def sub(m):
            v = env.get(m.group(1), (None,))[0]
            if v is None:
                unknown.append(m.group(1))
                return ""
            return v
        out = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)
        return None if unknown else out

    def check_worker(self, where, pod, c, env, flag, tag):
        limits = (c.get("resources") or {}).get("limits") or {}
        device = self.expand(flag.get("device", "cpu"), env)
        gpu = "nvidia.com/gpu" in limits
        if device == "cuda" and not gpu:
            self.bad(where, "--device=cuda without a nvidia.com/gpu limit")
        if device == "cuda" and "cuda" not in tag:
            self.bad(where, f"--device=cuda on image tag {tag!r}: the default image's LibTorch has "
                            "no CUDA (use the CUDA build, tag ...-cuda)")
        if device == "cpu" and gpu:
            self.bad(where, "a nvidia.com/gpu limit with --device=cpu: the GPU would sit idle")
        region_var = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", flag.get("region", ""))
        source = env.get(region_var.group(1)) if region_var else None
        if source is None or "configMapKeyRef" not in (source[1].get("valueFrom") or {}):
            self.bad(where, "--region must come from the region ConfigMap (env configMapKeyRef)")
            return
        selected = (pod.get("nodeSelector") or {}).get(REGION_LABEL)
        if source[0] in (None, "", "local", "REGION") or selected != source[0]:
            self.bad(where, f"--region is {source[0]!r} but the nodeSelector's {REGION_LABEL} is "
                            f"{selected!r}: they must be the same real region")
        for address in (self.expand(flag.get("coordinator", ""), env) or "").split(","):
            self.check_pod_address(where, "--coordinator", address)

    def check_coordinator(self, where, w, env, flag):
        store = flag.get("store", "file")
        if w["spec"].get("replicas", 1) > 1:
            if not store.startswith("etcd://"):
                self.bad(where, f"{w['spec']['replicas']} replicas need --store=etcd://, not {store!r}")
            if "advertise_address" not in flag:
                self.bad(where, "several coordinators need --advertise_address")
        if store.startswith("etcd://"):
            for address in store[len("etcd://"):].split(","):
                self.check_pod_address(where, "--store", address)

    def check_pod_address(self, where, what, address):
        """An in-cluster POD.SERVICE.NAMESPACE.svc:PORT names a pod that exists."""
        m = re.fullmatch(r"([a-z0-9-]+)-(\d+)\.([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)", address)
        if not m:
            if ".svc" in address:
                self.bad(where, f"{what}: {address!r} is not POD.SERVICE.NAMESPACE.svc:PORT")
            return
        name, ordinal, service, namespace, port = m.groups()
        sets = [s for s in self.named("StatefulSet").values()
                if s["metadata"]["name"] == name and s["spec"].get("serviceName") == service
                and s["metadata"]["namespace"] == namespace]
        if not sets or int(ordinal) >= sets[0]["spec"].get("replicas", 1):
            self.bad(where, f"{what}: {address!r} names no pod of a StatefulSet {name!r} "
                            f"under Service {service!r}")
            return
        ports = {p.get("containerPort") for c in sets[0]["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        if int(port) not in ports:
            self.bad(where, f"{what}: {address!r}: port {port} is not a container port of {name}")

    def check_flags(self, where, binary, subcommand, args):
        known = self.flag_lookup(binary, subcommand)
        for arg in args:
            if not arg.startswith("--"):
                continue
            flag = arg[2:].split("=", 1)[0]
            if flag in known:
                continue
            self.bad(where, f"{binary}{' ' + subcommand if subcommand else ''} has no flag --{flag}")

    def check_file(self, where, path, mounts, secrets):
        for mount_path, volume in mounts.items():
            if not path.startswith(mount_path + "/"):
                continue
            key = path[len(mount_path) + 1:]
            if "secret" in volume:
                name = volume["secret"].get("secretName")
                if name in secrets and key not in secrets[name]:
                    self.bad(where, f"{path}: Secret {name!r} has no key {key!r}")
            elif "csi" in volume and key not in CERT_KEYS:
                self.bad(where, f"{path}: the CSI volume {volume['name']!r} holds only "
                                f"{sorted(CERT_KEYS)}")

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
            self.check_file(where, value.replace("$(POD_NAME)", pod_name), mounts, secrets)


def load_file(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def render(overlay):
    out = subprocess.run(["kubectl", "kustomize", overlay], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        return None, out.stderr.strip()
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None], None


def mutate(docs, kind, name, edit):
    out = copy.deepcopy(docs)
    for d in out:
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            edit(d)
    return out


def self_test(docs, given, lookup):
    """Each broken copy of the single-cluster overlay must be refused with the expected words."""
    def container(d):
        return d["spec"]["template"]["spec"]["containers"][0]

    def env(d, name):
        return next(e for e in container(d)["env"] if e["name"] == name)
    worker, coordinator = "detour-worker", "detour-coordinator"
    cases = [
        ("Certificate's Secret renamed", mutate(docs, "Certificate", "detour-coordinator",
                                                lambda d: d["spec"].update(secretName="other")),
         "is neither in the manifests"),
        ("unknown flag", mutate(docs, "StatefulSet", worker,
                                lambda d: container(d)["args"].append("--gpu_count=8")), "no flag --gpu_count"),
        ("probe port", mutate(docs, "StatefulSet", coordinator,
                              lambda d: container(d)["livenessProbe"]["httpGet"].update(port="http")),
         "'http' is not a container port name"),
        ("service target", mutate(docs, "Service", worker,
                                  lambda d: d["spec"]["ports"][0].update(targetPort="rpc")), "targetPort 'rpc'"),
        ("secret key", mutate(docs, "StatefulSet", coordinator,
                              lambda d: container(d)["args"].append("--tls_ca=/etc/detour/tls/root.crt")),
         "has no key 'root.crt'"),
        ("csi file", mutate(docs, "StatefulSet", worker,
                            lambda d: container(d)["args"].append("--tls_ca=/etc/detour/tls/ca.pem")),
         "holds only"),
        ("cuda on cpu image", mutate(docs, "StatefulSet", worker,
                                     lambda d: env(d, "DETOUR_DEVICE").update(value="cuda")),
         "without a nvidia.com/gpu limit"),
        ("kind", mutate(docs, "Service", worker, lambda d: d.update(apiVersion="v2")), "apiVersion"),
        ("selector", mutate(docs, "StatefulSet", worker,
                            lambda d: d["spec"]["selector"]["matchLabels"].update(x="y")), "matchLabels"),
        ("env", mutate(docs, "StatefulSet", worker,
                       lambda d: container(d)["env"].pop(0)), "$(POD_NAME) is not"),
        ("env order", mutate(docs, "StatefulSet", coordinator,
                             lambda d: container(d)["env"].reverse()), "is not defined before it"),
        ("scrape port", mutate(docs, "StatefulSet", worker,
                               lambda d: d["spec"]["template"]["metadata"]["annotations"].update(
                                   {"prometheus.io/port": "9999"})), "prometheus.io/port '9999'"),
        ("latest", mutate(docs, "StatefulSet", "detour-etcd",
                          lambda d: container(d).update(image="quay.io/coreos/etcd:latest")), "not pinned"),
        ("no startup probe", mutate(docs, "StatefulSet", coordinator,
                                    lambda d: container(d).pop("startupProbe")), "no startupProbe"),
        ("region", mutate(docs, "StatefulSet", worker,
                          lambda d: d["spec"]["template"]["spec"]["nodeSelector"].update(
                              {REGION_LABEL: "mars-1"})), "they must be the same real region"),
        ("etcd address", mutate(docs, "StatefulSet", "detour-etcd", lambda d: d["spec"].update(replicas=2)),
         "names no pod of a StatefulSet 'detour-etcd'"),
        ("no pdb", [d for d in docs if d["kind"] != "PodDisruptionBudget"], "no PodDisruptionBudget"),
        ("no account", [d for d in docs if d["kind"] != "ServiceAccount"], "is not a ServiceAccount"),
        ("issuer", mutate(docs, "Issuer", "detour-ca", lambda d: d["metadata"].update(name="ca")),
         "is not an Issuer"),
        ("policy port", mutate(docs, "NetworkPolicy", worker,
                               lambda d: d["spec"]["ingress"][0]["ports"][0].update(port="tensor")),
         "'tensor' is not a port name"),
    ]
    failed = []
    for label, broken, expect in cases:
        problems = Checker(broken, lookup, given).run()
        if not any(expect in p for p in problems):
            failed.append(f"self-test {label}: expected a problem with {expect!r}, got {problems}")
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="deploy/k8s")
    parser.add_argument("--bin_dir", required=True, help="build tree holding the binaries")
    parser.add_argument("--self_test", action="store_true")
    a = parser.parse_args()
    if shutil.which("kubectl") is None:
        print("k8s_check: kubectl not found: the overlays cannot be rendered; skipped")
        return 77
    cache = {}

    def lookup(binary, subcommand):
        key = (binary, subcommand)
        if key not in cache:
            cache[key] = flags_of(a.bin_dir, binary, subcommand)
        return cache[key]

    given = load_file(os.path.join(a.root, "secrets.example.yaml"))
    overlays = sorted(os.path.dirname(p) for p in glob.glob(
        os.path.join(a.root, "overlays", "**", "kustomization.yaml"), recursive=True))
    if not overlays:
        print(f"k8s_check: no overlays under {a.root}/overlays")
        return 1
    problems, rendered = [], {}
    for overlay in overlays:
        label = os.path.relpath(overlay, a.root)
        docs, error = render(overlay)
        if docs is None:
            problems.append(f"{label}: kubectl kustomize failed: {error}")
            continue
        rendered[label] = docs
        found = Checker(docs, lookup, given).run()
        problems += [f"{label}: {p}" for p in found]
        kinds = sorted({f"{d['kind']}/{d['metadata']['name']}" for d in docs})
        print(f"k8s_check: {label}: {len(docs)} objects ({', '.join(kinds)}): "
              f"{'OK' if not found else f'{len(found)} problems'}")
    single = rendered.get(os.path.join("overlays", "single-cluster"))
    if a.self_test:
        if single is None:
            problems.append("self-test: needs the overlay single-cluster")
        else:
            problems += self_test(single, given, lookup)
    for p in problems:
        print(f"k8s_check: {p}")
    print(f"k8s_check: {len(overlays)} overlays: {'OK' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
