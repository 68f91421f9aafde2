"""A coordinator and workers of this build as local processes, for the runtime
benchmarks (elastic_churn.py, stage_moves.py): start them on ephemeral ports
(each writes a ready file), talk to the coordinator with detourctl --json,
read its /metrics, stop everything with SIGTERM (SIGKILL after 15 s).
Plaintext (--insecure): the benchmarks measure the runtime, not TLS."""
import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def benchmark_parser(doc, iterations, modes):
    """The options every runtime benchmark has: --build, --iterations, --modes
    (a comma-separated subset of `modes`, all by default) and --json. Add the
    script's own, then call parse_benchmark_args."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="build directory with the daemons and detourctl (default: %(default)s)")
    ap.add_argument("--iterations", type=int, default=iterations,
                    help="iterations of the job in each run (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(modes),
                    help=f"comma-separated runs, of {', '.join(modes)} (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.set_defaults(allowed_modes=tuple(modes))
    return ap


def parse_benchmark_args(ap):
    """Parses; a bad --iterations or --modes is a usage error (exit 2)."""
    args = ap.parse_args()
    if args.iterations < 1:
        ap.error("--iterations must be at least 1")
    bad = [m for m in args.modes.split(",") if m not in args.allowed_modes]
    if bad:
        ap.error(f"--modes: unknown run {bad[0]!r} ({', '.join(args.allowed_modes)})")
    return args


def wait_ready(path, field, timeout=30):
    """The ready file's JSON once it names `field` (a daemon writes it when it listens)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(path) as f:
                data = json.load(f)
            if field in data:
                return data
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{path}: no {field} after {timeout}s")


class LocalCluster:
    """One coordinator (with `coordinator_flags`) in a fresh temporary directory;
    workers are added with start_worker. Logs: DIR/c.log and DIR/<worker>.log."""

    def __init__(self, build, prefix, coordinator_flags=()):
        self.build = build
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.procs = {}
        ready = os.path.join(self.dir, "c.ready")
        self.coordinator = subprocess.Popen(
            [os.path.join(build, "coordinator/detour-coordinator"), "--listen=127.0.0.1:0",
             "--insecure", "--metrics_port=0", "--metrics_bind=127.0.0.1",
             f"--data_dir={self.dir}/c", "--worker_silence=3s", "--heartbeat_interval=500ms",
             f"--ready_file={ready}", *coordinator_flags],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "c.log"), "w"))
        info = wait_ready(ready, "grpc_port")
        self.port = info["grpc_port"]
        self.metrics_port = info.get("metrics_port")

    def start_worker(self, wid, region="local", flags=()):
        """Starts worker `wid` (one LibTorch thread) and waits until it listens."""
        ready = os.path.join(self.dir, f"{wid}.ready")
        self.procs[wid] = subprocess.Popen(
            [os.path.join(self.build, "worker/detour-worker"), "--listen=127.0.0.1:0",
             "--insecure", "--metrics_port=0", "--metrics_bind=127.0.0.1",
             f"--coordinator=127.0.0.1:{self.port}", f"--data_dir={self.dir}/{wid}",
             f"--region={region}", f"--worker_id={wid}", "--torch_threads=1",
             f"--ready_file={ready}", *flags],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, f"{wid}.log"), "w"))
        wait_ready(ready, "grpc_port")
        return wid

    def ctl(self, *argv):
        """detourctl --json ARGV against the coordinator: its parsed output."""
        out = subprocess.run([os.path.join(self.build, "tools/detourctl/detourctl"),
                              f"--coordinator=127.0.0.1:{self.port}", "--insecure", "--json",
                              *argv], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"detourctl {' '.join(argv)}: {out.stderr}")
        return json.loads(out.stdout) if out.stdout.strip() else {}

    def metric(self, name):
        """An unlabelled sample of the coordinator's /metrics (0 when absent)."""
        if not self.metrics_port:
            return 0.0
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{}"):
                return float(line.split()[-1])
        return 0.0

    def stop(self):
        """SIGTERM to every process still running, SIGKILL to any not gone in 15 s."""
        for p in list(self.procs.values()) + [self.coordinator]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in list(self.procs.values()) + [self.coordinator]:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
