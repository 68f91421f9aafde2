#!/usr/bin/env python3
"""The detour Python client against real daemons on loopback.

    client_test.py [--source_dir DIR] [--build_dir DIR] [unittest flags]

$DETOUR_SOURCE_DIR / $DETOUR_BUILD_DIR, when set, win over the flags (as
for the C++ tests). The `detour` package must be importable: ctest puts the
build's python/ directory on PYTHONPATH. Starts, per test class, a
coordinator (port 0: the kernel picks a free port; read back from its
--ready_file) and, for the TLS class, two workers that run a tiny job to the
end; certificates come from tools/gen_certs.sh in a temporary directory.
Every process is stopped (SIGTERM, then SIGKILL) and every file removed,
whatever the outcome.
"""

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from unittest import mock

import grpc

try:
    import detour
except ImportError as e:
    sys.exit("client_test.py: cannot import the detour package (%s): build the detour_python "
             "target and put <build>/python on PYTHONPATH (ctest does)" % e)

READ_TOKEN = "py-test-read-token-0001"
SUBMIT_TOKEN = "py-test-submit-token-0001"
CERT_READER_TOKEN = "py-test-cert-reader-token"  # gives certificate CN py-reader the read role
OWNER_TOKEN = "py-test-owner-token-0001"  # submit, named py-alice: her jobs' owner

SOURCE_DIR = ""
BUILD_DIR = ""


def binary(relative):
    return os.path.join(BUILD_DIR, relative)


COORDINATOR = "coordinator/detour-coordinator"
WORKER = "worker/detour-worker"


def pending_spec(name):
    """A job that stays PENDING with two workers: it needs 1 + 3 × 2 = 7."""
    return {
        "name": name,
        "model": {"num_layers": 4, "d_model": 32, "num_heads": 2, "ffn_dim": 64,
                  "context_length": 16},
        "pipeline": {"num_stages": 4, "data_nodes": 1, "replicas_per_stage": 2},
        "iterations": 5,
        "checkpoint": {"disabled": True},
    }


def micro_spec(name, iterations):
    """tests/e2e/micro_job.h's MicroJob(2, 1, 1, 0.0, iterations) as a dict."""
    return {
        "name": name,
        "model": {"num_layers": 2, "d_model": 32, "num_heads": 2, "ffn_dim": 64,
                  "context_length": 16},
        "pipeline": {"num_stages": 2, "data_nodes": 1, "replicas_per_stage": 1,
                     "microbatches_per_data_node": 2, "samples_per_microbatch": 2,
                     "scheduler": "SCHEDULER_FULL"},
        "optimizer": {"adamw": {"lr": 3e-3}},
        "iterations": iterations,
        "seed": 11,
        "checkpoint": {"disabled": True},
    }


class Daemon:
    """A daemon child process in its own session, with its log in a file."""

    def __init__(self, argv, log, ready_file):
        self.log = log
        self.ready_file = ready_file
        with open(log, "wb") as out:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.ready = self._wait_ready(20.0)

    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError("%s exited with %d before it was ready:\n%s" % (
                    self.process.args[0], self.process.returncode, self.log_text()))
            try:
                with open(self.ready_file, encoding="utf-8") as f:
                    ready = json.load(f)
                if ready.get("grpc_port"):
                    return ready
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError("%s not ready within %.0f s:\n%s" % (
            self.process.args[0], timeout, self.log_text()))

    @property
    def port(self):
        return int(self.ready["grpc_port"])

    def log_text(self):
        try:
            with open(self.log, encoding="utf-8", errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)


class FakeFollower:
    """A gRPC server on 127.0.0.1 that answers every unary call as a
    coordinator following `leader` does: UNAVAILABLE naming the leader in the
    message and in the detour-leader trailing metadata. TLS with
    `credentials` (grpc.ssl_server_credentials), else plaintext."""

    def __init__(self, leader, credentials=None):
        self.calls = 0

        def refuse(request, context):
            del request
            self.calls += 1
            context.set_trailing_metadata(((detour.client.LEADER_METADATA, leader),))
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "this coordinator is not the leader; the leader is at " + leader)

        class Handler(grpc.GenericRpcHandler):
            def service(self, handler_call_details):
                del handler_call_details
                return grpc.unary_unary_rpc_method_handler(refuse)

        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((Handler(),))
        if credentials is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()

    def stop(self):
        self.server.stop(grace=None)


def gen_certs(out, *names):
    subprocess.run([os.path.join(SOURCE_DIR, "tools/gen_certs.sh"), out] + list(names),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30)


class OfflineTest(unittest.TestCase):
    """What needs no daemon: the generated modules, the typed views, error parsing."""

    def test_generated_modules_live_inside_the_package(self):
        from detour._proto.detour.v1 import job_service_pb2, job_service_pb2_grpc
        self.assertEqual(job_service_pb2.Job.__module__, "detour._proto.detour.v1.job_service_pb2")
        self.assertTrue(hasattr(job_service_pb2_grpc, "JobServiceStub"))
        self.assertEqual(job_service_pb2.Job.DESCRIPTOR.file.name, "detour/v1/job_service.proto")
        with self.assertRaises(ImportError):
            __import__("detour.v1")  # no top-level copies of the generated packages

    def test_a_single_name_is_resolved_to_every_address(self):
        """One host:port whose host is a DNS name stands for every address it
        resolves to; the certificate is verified against the name."""
        answer = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 7070)),
                  (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::2", 7070, 0, 0)),
                  (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 7070))]
        with mock.patch("socket.getaddrinfo", return_value=answer) as lookup, \
                mock.patch("grpc.secure_channel") as channel:
            c = detour.Client("coordinators.example:7070")
            lookup.assert_called_once_with("coordinators.example", 7070, type=socket.SOCK_STREAM)
            self.assertEqual(c._addresses, ["10.0.0.1:7070", "[fd00::2]:7070"])
            self.assertEqual(c.address, "10.0.0.1:7070")
            self.assertEqual(channel.call_args.args[0], "10.0.0.1:7070")
            self.assertIn(("grpc.ssl_target_name_override", "coordinators.example"),
                          channel.call_args.kwargs["options"])
            # A leader named by a redirection is verified against its own host.
            c._connect("leader.example:7070")
            self.assertNotIn("grpc.ssl_target_name_override",
                             [k for k, _ in channel.call_args.kwargs["options"]])
            # An explicit server_name wins.
            c = detour.Client("coordinators.example:7070", server_name="other.example")
            overrides = [v for k, v in channel.call_args.kwargs["options"]
                         if k == "grpc.ssl_target_name_override"]
            self.assertEqual(overrides, ["other.example"])
            # IP literals and lists are taken as they are.
            lookup.reset_mock()
            for address in ("127.0.0.1:7070", "[::1]:7070", "a.example:1,b.example:2",
                            "unix:/tmp/socket"):
                c = detour.Client(address, insecure=True)
                self.assertEqual(c.address, address.split(",")[0])
            lookup.assert_not_called()
        # A name that does not resolve is kept (the first call fails).
        with mock.patch("socket.getaddrinfo", side_effect=socket.gaierror(-2, "unknown")):
            c = detour.Client("nowhere.invalid:7070", insecure=True)
            self.assertEqual(c._addresses, ["nowhere.invalid:7070"])
            c.close()

    def test_views_cover_every_proto_field(self):
        proto = {f.name for f in detour.pb.JobProgress.DESCRIPTOR.fields}
        self.assertEqual({f.name for f in dataclasses.fields(detour.Progress)}, proto)
        names = {v.name[len("JOB_STATE_"):] for v in detour.pb.JobState.DESCRIPTOR.values}
        self.assertEqual({s.name for s in detour.JobState}, names)
        self.assertEqual(detour.JobState.parse("JOB_STATE_RUNNING"), detour.JobState.RUNNING)
        self.assertEqual(detour.JobState.parse(4), detour.JobState.SUCCEEDED)
        self.assertTrue(detour.JobState.CANCELLED.ended)
        self.assertEqual(str(detour.JobState.FAILED), "failed")
        with self.assertRaises(ValueError):
            detour.JobState.parse(99)
        # A number this client does not know yet (a newer coordinator's) still reads.
        job = detour.Job.from_proto(detour.pb.Job(id="j", state=42, history=[
            detour.pb.JobHistoryEvent(kind=77, message="new")]))
        self.assertEqual(job.state, detour.JobState.UNSPECIFIED)
        self.assertEqual(job.history[0].kind, "unknown_77")
        self.assertIsNone(job.create_time)
        # Planned visits read as a plain dict; the new event kinds by name.
        job = detour.Job.from_proto(detour.pb.Job(
            id="j", progress=detour.pb.JobProgress(planned_visits={"w1": 6, "w2": 2}),
            history=[detour.pb.JobHistoryEvent(kind=detour.pb.JobHistoryEvent.KIND_REASSIGNED),
                     detour.pb.JobHistoryEvent(kind=detour.pb.JobHistoryEvent.KIND_STRAGGLER)]))
        self.assertEqual(job.progress.planned_visits, {"w1": 6, "w2": 2})
        self.assertEqual([e.kind for e in job.history], ["reassigned", "straggler"])
        hash(job.progress)  # still hashable: the dict is left out of the hash

    def test_followed_events_survive_the_rolling_window(self):
        def event(*iterations):
            history = [detour.pb.JobHistoryEvent(iteration=i, message="e%d" % i)
                       for i in iterations]
            return detour.JobEvent.from_proto(detour.pb.JobEvent(
                job=detour.pb.Job(id="j", history=history)))
        # The record keeps the newest entries: 1..3, then 2..4 (1 rolled out), then 4..6.
        stream = [event(), event(1, 2, 3), event(2, 3, 4), event(2, 3, 4), event(4, 5, 6)]
        got = [e.iteration for e in detour.Client._new_history(stream)]
        self.assertEqual(got, [1, 2, 3, 4, 5, 6])

    def test_import_errors_name_their_cause(self):
        # Each missing dependency is named with the package that brings it,
        # not hidden behind "No module named 'google'".
        cases = [("google.protobuf", "protobuf runtime (module google.protobuf)",
                  "pip install protobuf"),
                 ("grpc", "gRPC (module grpc)", "pip install grpcio"),
                 ("detour._proto", "generated modules (detour._proto) are missing",
                  "detour_python")]
        for blocked, named, remedy in cases:
            code = "import sys; sys.modules[%r] = None; import detour" % blocked
            result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                    text=True, timeout=60)
            self.assertNotEqual(result.returncode, 0, blocked)
            self.assertIn(named, result.stderr, blocked)
            self.assertIn(remedy, result.stderr, blocked)

    def test_token_files_others_may_read_are_refused(self):
        directory = tempfile.mkdtemp(prefix="detour-pytest-token-")
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        token_file = os.path.join(directory, "token")
        with open(token_file, "w", encoding="utf-8") as f:
            f.write(READ_TOKEN + "\n")
        for mode in (0o644, 0o640, 0o604, 0o620):
            os.chmod(token_file, mode)
            with self.assertRaises(detour.ConfigError) as e:
                detour.Client("127.0.0.1:1", insecure=True, token_file=token_file)
            self.assertIn("%s has mode %04o" % (token_file, mode), e.exception.message)
            self.assertIn("chmod 600 " + token_file, e.exception.message)
        for mode in (0o600, 0o400):
            os.chmod(token_file, mode)
            detour.Client("127.0.0.1:1", insecure=True, token_file=token_file).close()

    def test_job_view_has_the_owner(self):
        job = detour.Job.from_proto(detour.pb.Job(id="j", owner="alice"))
        self.assertEqual(job.owner, "alice")
        self.assertEqual(detour.Job.from_proto(detour.pb.Job(id="j")).owner, "")

    def test_error_messages_name_the_field(self):
        from detour.errors import spec_field
        self.assertEqual(spec_field("spec: pipeline.skip_ratio: 1.5 is outside [0, 1)"),
                         "pipeline.skip_ratio")
        self.assertEqual(spec_field("spec: pipeline.assignment[2]: repeats w1"),
                         "pipeline.assignment[2]")
        self.assertIsNone(spec_field("spec is over 1 MiB"))
        error = detour.InvalidSpec("spec: name: bad", field="name",
                                   code=grpc.StatusCode.INVALID_ARGUMENT,
                                   method="submit")
        self.assertEqual(str(error), "submit: INVALID_ARGUMENT: spec: name: bad")
        self.assertIsInstance(error, detour.DetourError)


    def test_spec_errors_say_where_and_what_is_valid(self):
        from detour.spec import load_spec
        # An enum value that does not exist: the valid ones are listed,
        # the _UNSPECIFIED zero left out.
        with self.assertRaises(detour.InvalidSpec) as e:
            load_spec({"name": "x", "pipeline": {"scheduler": "SCHEDULER_NOPE"}})
        self.assertEqual(e.exception.field, "pipeline.scheduler")
        self.assertIn("SCHEDULER_NOPE is not one of SCHEDULER_SKIPPIPE, SCHEDULER_FULL",
                      str(e.exception))
        self.assertNotIn("UNSPECIFIED", str(e.exception))
        # A misspelt field: the nearest one is suggested.
        with self.assertRaises(detour.InvalidSpec) as e:
            load_spec({"name": "x", "pipeline": {"skip_ration": 0.1}})
        self.assertEqual(e.exception.field, "pipeline.skip_ration")
        self.assertIn("did you mean skip_ratio?", str(e.exception))
        # Bad JSON in a file: the line and column of the fault.
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bad.json")
            with open(path, "w", encoding="utf-8") as f:
                f.write('{"name": "x",\n "iterations": 3,,\n}')
            with self.assertRaisesRegex(detour.InvalidSpec,
                                        r"bad.json: not valid JSON: .*line 2 column 18"):
                load_spec(path)

    def test_a_mistyped_command_gets_a_suggestion(self):
        def cli(*args):
            result = subprocess.run([sys.executable, "-m", "detour"] + list(args),
                                    capture_output=True, text=True, timeout=30, check=False)
            return result.returncode, result.stderr

        # Our suggestion, or the one newer argparse versions make themselves.
        suggests = re.compile(r"\(did you mean %s\?\)|maybe you meant '%s'")
        code, err = cli("sumbit", "spec.json")
        self.assertEqual(code, 2, err)
        self.assertIn("invalid choice: 'sumbit'", err)
        self.assertRegex(err, suggests.pattern % ("submit", "submit"))
        code, err = cli("--insecure", "evnets", "job-1")
        self.assertEqual(code, 2, err)
        self.assertRegex(err, suggests.pattern % ("events", "events"))
        # Nothing near: the choices alone.
        code, err = cli("frobnicate")
        self.assertEqual(code, 2, err)
        self.assertIn("choose from", err)
        self.assertNotIn("did you mean", err)
        self.assertNotIn("meant", err)

    def test_the_port_probe_tells_servers_apart(self):
        from detour import _probe
        self.assertEqual(_probe.classify(b"HTTP/1.0 200 OK\r\n"), _probe.HTTP1)
        self.assertEqual(_probe.classify(bytes([21, 3, 3, 0, 2])), _probe.TLS)
        self.assertEqual(_probe.classify(bytes([0, 0, 18, 4, 0, 0, 0, 0, 0])), _probe.HTTP2_PLAIN)
        self.assertIsNone(_probe.classify(b""))
        self.assertIsNone(_probe.classify(b"SSH-2.0-OpenSSH"))
        self.assertIsNone(_probe.probe_port("not-an-address", 1.0))
        self.assertIsNone(_probe.probe_port("127.0.0.1:1", 1.0))  # nobody listens
        self.assertIn("drop insecure=True", _probe.port_hint("h:1", False, _probe.TLS))
        self.assertEqual(_probe.port_hint("h:1", True, _probe.TLS), "")
        self.assertIn("use insecure=True", _probe.port_hint("h:1", True, _probe.HTTP2_PLAIN))
        self.assertEqual(_probe.port_hint("h:1", True, None), "")

    def test_a_metrics_port_given_as_the_coordinator_gets_a_hint(self):
        import http.server

        class Metrics(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the handler's name is http.server's)
                body = b"# HELP up whether it is up\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        class Quiet(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # gRPC hangs up on the HTTP/1 answer: expected, not news

        server = Quiet(("127.0.0.1", 0), Metrics)
        self.addCleanup(server.server_close)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.shutdown)
        address = "127.0.0.1:%d" % server.server_address[1]
        for insecure in (True, False):
            with self.subTest(insecure=insecure):
                kwargs = {"insecure": True} if insecure else {}
                with detour.Client(address, timeout=3, **kwargs) as c:
                    with self.assertRaises((detour.Unavailable, detour.DeadlineExceeded)) as e:
                        c.list()
                self.assertIn("is it a metrics port?", e.exception.hint)
                self.assertIn("(hint: %s answers plain HTTP/1" % address, str(e.exception))


class ClusterTest(unittest.TestCase):
    """Starts daemons once per class; cleanups run even when set-up fails."""

    @classmethod
    def make_dir(cls):
        cls.dir = tempfile.mkdtemp(prefix="detour-pytest-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, ignore_errors=True)

    @classmethod
    def start(cls, name, argv):
        ready = os.path.join(cls.dir, name + ".ready")
        daemon = Daemon(argv + ["--ready_file=" + ready], os.path.join(cls.dir, name + ".log"),
                        ready)
        cls.addClassCleanup(daemon.stop)
        return daemon

    @classmethod
    def start_coordinator(cls, security):
        for path in (COORDINATOR,):
            if not os.access(binary(path), os.X_OK):
                raise AssertionError("%s is not built (build the detour-coordinator target)"
                                     % binary(path))
        return cls.start("coordinator", [
            binary(COORDINATOR), "--listen=127.0.0.1:0", "--metrics_port=0",
            "--metrics_bind=127.0.0.1", "--data_dir=" + os.path.join(cls.dir, "coordinator"),
            "--worker_silence=1500ms", "--heartbeat_interval=200ms"] + security)

    def setUp(self):
        patcher = mock.patch.dict(os.environ)
        patcher.start()
        self.addCleanup(patcher.stop)
        for name in ("DETOUR_TOKEN", "DETOUR_COORDINATOR"):
            os.environ.pop(name, None)


class TlsCoordinatorTest(ClusterTest):
    """TLS with --auth_tokens: tokens with roles, a certificate with a role, two workers."""

    @classmethod
    def setUpClass(cls):
        cls.make_dir()
        cls.certs = os.path.join(cls.dir, "certs")
        gen_certs(cls.certs, "--coordinator", "coordinator", "--worker", "w0", "w1",
                  "--client", "py-reader")
        cls.other_ca = os.path.join(cls.dir, "other-ca")
        gen_certs(cls.other_ca, "--coordinator", "coordinator")
        cls.ca = os.path.join(cls.certs, "ca.crt")
        tokens = os.path.join(cls.dir, "tokens")
        with open(tokens, "w", encoding="utf-8") as f:
            f.write("# python client test\n%s read\n%s submit\n%s read py-reader\n"
                    "%s submit py-alice\n"
                    % (READ_TOKEN, SUBMIT_TOKEN, CERT_READER_TOKEN, OWNER_TOKEN))
        os.chmod(tokens, 0o600)  # the coordinator refuses a tokens file others may read
        cls.coordinator = cls.start_coordinator(cls.tls("coordinator") +
                                                ["--auth_tokens=" + tokens])
        cls.address = "127.0.0.1:%d" % cls.coordinator.port
        cls.workers = []
        if os.access(binary(WORKER), os.X_OK):
            for name in ("w0", "w1"):
                cls.workers.append(cls.start(name, [
                    binary(WORKER), "--listen=127.0.0.1:0", "--metrics_port=0",
                    "--metrics_bind=127.0.0.1", "--coordinator=" + cls.address,
                    "--data_dir=" + os.path.join(cls.dir, name), "--region=Oregon",
                    "--torch_threads=1"] + cls.tls(name)))

    @classmethod
    def tls(cls, name):
        prefix = os.path.join(cls.certs, name)
        return ["--tls_cert=%s.crt" % prefix, "--tls_key=%s.key" % prefix,
                "--tls_ca=" + os.path.join(cls.certs, "ca.crt")]

    def client(self, address=None, **kwargs):
        kwargs.setdefault("ca", self.ca)
        if kwargs.get("insecure"):
            del kwargs["ca"]
        client = detour.Client(address or self.address, **kwargs)
        self.addCleanup(client.close)
        return client

    def submitter(self):
        return self.client(token=SUBMIT_TOKEN)

    def test_submit_dict_get_list_cancel(self):
        c = self.submitter()
        first = c.submit(pending_spec("py-dict-1"))
        second = c.submit(pending_spec("py-dict-2"))
        self.assertNotEqual(first, second)
        job = c.get(first)
        self.assertIsInstance(job, detour.Job)
        self.assertEqual(job.id, first)
        self.assertEqual(job.name, "py-dict-1")
        self.assertEqual(job.state, detour.JobState.PENDING)
        self.assertFalse(job.ended)
        self.assertIn("worker", job.message)  # what it waits for
        self.assertIsNotNone(job.create_time)
        self.assertLess(abs(time.time() - job.create_time.timestamp()), 60)
        self.assertIsNone(job.end_time)
        # The coordinator's defaults are in the stored spec.
        self.assertEqual(job.spec.pipeline.max_jump, 3)
        self.assertEqual(job.spec_dict()["pipeline"]["num_stages"], 4)
        self.assertEqual(job.progress.total_iterations, 5)

        ids = [j.id for j in c.list()]
        self.assertLess(ids.index(second), ids.index(first))  # newest first
        self.assertEqual([j.id for j in c.iter_jobs(page_size=1)], ids)  # one job per page
        self.assertIn(first, [j.id for j in c.list("pending")])
        self.assertIn(first, [j.id for j in c.list(detour.JobState.PENDING)])
        self.assertNotIn(first, [j.id for j in c.list(state="succeeded")])
        with self.assertRaisesRegex(ValueError, "not a job state"):
            c.list("sleeping")

        cancelled = c.cancel(first)
        self.assertEqual(cancelled.state, detour.JobState.CANCELLED)
        self.assertTrue(c.get(first).ended)
        self.assertIsNotNone(c.get(first).end_time)
        self.assertNotIn(first, [j.id for j in c.list("pending")])
        with self.assertRaises(detour.FailedPrecondition) as e:
            c.cancel(first)
        self.assertEqual(e.exception.method, "cancel")
        c.cancel(second)

        with self.assertRaises(detour.NotFound) as e:
            c.get("job-999999")
        self.assertIn("job-999999", e.exception.message)
        with self.assertRaises(detour.NotFound):
            c.cancel("job-999999")
        with self.assertRaises(detour.InvalidArgument):
            c.get("")

    def test_submit_file_and_message(self):
        c = self.submitter()
        # The JSON form detourctl reads: lowerCamelCase names work too.
        spec = pending_spec("py-file")
        spec["pipeline"] = {"numStages": 4, "dataNodes": 1, "replicasPerStage": 2,
                            "scheduler": "SCHEDULER_SKIPPIPE"}
        path = os.path.join(self.dir, "spec.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        for given in (path, pathlib.Path(path)):
            job = c.get(c.submit(given))
            self.assertEqual(job.name, "py-file")
            self.assertEqual(job.spec.pipeline.replicas_per_stage, 2)
            c.cancel(job.id)
        # An example of the tree, as shipped.
        example = os.path.join(SOURCE_DIR, "examples/jobs/tiny_local.json")
        job = c.get(c.submit(example))
        self.assertEqual(job.name, "tiny-local")
        c.cancel(job.id)
        # A message.
        message = detour.pb.JobSpec()
        message.CopyFrom(detour.load_spec(pending_spec("py-message")))
        job = c.get(c.submit(message))
        self.assertEqual(job.name, "py-message")
        c.cancel(job.id)

    def test_invalid_specs(self):
        c = self.submitter()
        # Refused locally, by the JSON mapping, before any call.
        cases = [
            ({"name": "x", "pipeline": {"skipRatio": 0.1, "bogus": 1}}, "pipeline.bogus",
             "no such field"),
            ({"name": "x", "pipeline": {"skip_ratio": "much"}}, "pipeline.skip_ratio", "float"),
            ({"name": "x", "pipeline": {"scheduler": "SCHEDULER_NOPE"}}, "pipeline.scheduler",
             "SCHEDULER_NOPE"),
            ({"name": "x", "iterations": -1}, "iterations", "out of range"),
            ({"name": "x", "nme": "y"}, "nme", "no such field"),
        ]
        for spec, field, words in cases:
            with self.subTest(spec=spec):
                with self.assertRaises(detour.InvalidSpec) as e:
                    c.submit(spec)
                self.assertEqual(e.exception.field, field)
                self.assertIn(words, str(e.exception))
                self.assertIn(field, str(e.exception))
                self.assertIsNone(e.exception.code)
        bad_json = os.path.join(self.dir, "bad.json")
        with open(bad_json, "w", encoding="utf-8") as f:
            f.write('{"name": "x",')
        with self.assertRaisesRegex(detour.InvalidSpec, "bad.json: not valid JSON"):
            c.submit(bad_json)
        with self.assertRaises(FileNotFoundError):
            c.submit(os.path.join(self.dir, "missing.json"))
        with self.assertRaises(TypeError):
            c.submit(42)
        for replicas in (-1, 1025, True, 1.5):
            with self.assertRaisesRegex(ValueError, "replicas_per_stage"):
                c.resume("job-000001", replicas_per_stage=replicas)  # type: ignore[arg-type]
        # Refused by the coordinator's validation, which names the field.
        spec = pending_spec("py-bad")
        spec["pipeline"]["skip_ratio"] = 1.5
        with self.assertRaises(detour.InvalidSpec) as e:
            c.submit(spec)
        self.assertEqual(e.exception.code.name, "INVALID_ARGUMENT")
        self.assertEqual(e.exception.field, "pipeline.skip_ratio")
        self.assertIn("outside [0, 1)", e.exception.message)
        spec = pending_spec("no spaces allowed")
        with self.assertRaises(detour.InvalidSpec) as e:
            c.submit(spec)
        self.assertEqual(e.exception.field, "name")
        self.assertIsInstance(e.exception, detour.InvalidArgument)

    def test_roles(self):
        job_id = self.submitter().submit(pending_spec("py-roles"))
        self.addCleanup(lambda: self.submitter().cancel(job_id))
        # read: may look, not change.
        reader = self.client(token=READ_TOKEN)
        self.assertIn(job_id, [j.id for j in reader.list()])
        self.assertEqual(reader.get(job_id).state, detour.JobState.PENDING)
        with self.assertRaises(detour.PermissionDenied) as e:
            reader.submit(pending_spec("py-denied"))
        self.assertIn("read", e.exception.message)
        with self.assertRaises(detour.PermissionDenied):
            reader.cancel(job_id)
        with self.assertRaises(detour.PermissionDenied):
            reader.resume(job_id)
        # A client certificate whose CN the tokens file gives the read role.
        prefix = os.path.join(self.certs, "py-reader")
        by_cert = self.client(cert=prefix + ".crt", key=prefix + ".key")
        self.assertIn(job_id, [j.id for j in by_cert.list()])
        with self.assertRaises(detour.PermissionDenied):
            by_cert.submit(pending_spec("py-denied"))
        # No credentials, or a token the coordinator does not know.
        with self.assertRaises(detour.Unauthenticated) as e:
            self.client().list()
        self.assertIn("needs credentials", e.exception.message)
        with self.assertRaises(detour.Unauthenticated):
            self.client().get(job_id)
        with self.assertRaises(detour.Unauthenticated) as e:
            self.client(token="not-a-token-it-knows").submit(pending_spec("py-x"))
        self.assertIn("unknown token", e.exception.message)

    def test_token_sources(self):
        token_file = os.path.join(self.dir, "token")
        with open(token_file, "w", encoding="utf-8") as f:
            f.write("  %s\n" % READ_TOKEN)
        os.chmod(token_file, 0o600)  # others may not read a token file
        self.assertIsInstance(self.client(token_file=token_file).list(), list)
        os.environ["DETOUR_TOKEN"] = SUBMIT_TOKEN
        c = self.client()
        c.cancel(c.submit(pending_spec("py-env")))
        # An explicit token wins over the environment.
        with self.assertRaises(detour.PermissionDenied):
            self.client(token=READ_TOKEN).submit(pending_spec("py-env2"))
        with open(token_file, "w", encoding="utf-8") as f:
            f.write("two words\n")
        with self.assertRaisesRegex(detour.ConfigError, "printable ASCII"):
            self.client(token_file=token_file)
        with self.assertRaisesRegex(detour.ConfigError, "not both"):
            self.client(token="a", token_file=token_file)
        with self.assertRaisesRegex(detour.ConfigError, "cannot read"):
            self.client(token_file=os.path.join(self.dir, "no-such-token"))

    def test_a_name_finds_the_leader_over_tls(self):
        """A TLS follower reached through "localhost": the certificate is
        verified against the name, and the client follows the follower to the
        leader."""
        prefix = os.path.join(self.certs, "coordinator")
        with open(prefix + ".key", "rb") as key, open(prefix + ".crt", "rb") as crt:
            credentials = grpc.ssl_server_credentials(((key.read(), crt.read()),))
        follower = FakeFollower(self.address, credentials)
        self.addCleanup(follower.stop)
        c = self.client("localhost:%d" % follower.port, token=READ_TOKEN)
        self.assertIsInstance(c.list(), list)
        self.assertEqual(c.address, self.address)
        self.assertGreaterEqual(follower.calls, 1)
        # A certificate for another name is refused.
        c = self.client("localhost:%d" % follower.port, token=READ_TOKEN,
                        server_name="elsewhere.example", timeout=5)
        with self.assertRaises(detour.Unavailable):
            c.list()

    def test_transport_errors(self):
        # A server certificate from another CA: the handshake fails.
        c = self.client(ca=os.path.join(self.other_ca, "ca.crt"), token=SUBMIT_TOKEN)
        with self.assertRaises(detour.Unavailable) as e:
            c.list()
        self.assertRegex(e.exception.message.lower(), "ssl|handshake|certificate")
        # Plaintext to a TLS port: the hint says so.
        with self.assertRaises(detour.Unavailable) as e:
            self.client(insecure=True, token=SUBMIT_TOKEN, timeout=5).list()
        self.assertIn("speaks TLS: drop insecure=True", e.exception.hint)
        # Nobody listening.
        with self.assertRaises(detour.Unavailable):
            self.client(address="127.0.0.1:1", timeout=5).list()

    def test_config_errors(self):
        key = os.path.join(self.certs, "py-reader.key")
        cert = os.path.join(self.certs, "py-reader.crt")
        with self.assertRaisesRegex(detour.ConfigError, "contradicts ca"):
            detour.Client(self.address, insecure=True, ca=self.ca)
        with self.assertRaisesRegex(detour.ConfigError, "both or neither"):
            detour.Client(self.address, ca=self.ca, cert=cert)
        with self.assertRaisesRegex(detour.ConfigError, "ca: cannot read .*missing.crt"):
            detour.Client(self.address, ca=os.path.join(self.dir, "missing.crt"))
        with self.assertRaisesRegex(detour.ConfigError, "ca: .* holds no PEM certificate"):
            detour.Client(self.address, ca=key)
        with self.assertRaisesRegex(detour.ConfigError, "key: .* holds no PEM private key"):
            detour.Client(self.address, ca=self.ca, cert=cert, key=cert)
        with self.assertRaisesRegex(detour.ConfigError, "timeout"):
            detour.Client(self.address, ca=self.ca, timeout=0)
        with self.assertRaisesRegex(detour.ConfigError, "printable"):
            detour.Client(self.address, ca=self.ca, token="has space")
        self.assertTrue(issubclass(detour.ConfigError, ValueError))
        c = detour.Client(self.address, ca=self.ca, token=READ_TOKEN)
        with c:
            c.list()
        with self.assertRaisesRegex(detour.DetourError, "closed"):
            c.list()

    def test_watch_deadline_and_early_stop(self):
        c = self.submitter()
        job_id = c.submit(pending_spec("py-watch-pending"))
        self.addCleanup(c.cancel, job_id)
        with self.assertRaises(detour.DeadlineExceeded):
            for _ in c.watch(job_id, timeout=1.0):
                pass
        stream = c.watch(job_id)
        first = next(stream)
        self.assertEqual(first.job.id, job_id)
        self.assertEqual(first.state, detour.JobState.PENDING)
        stream.close()  # cancels the call; nothing hangs
        with self.assertRaises(detour.NotFound):
            next(c.watch("job-999999"))

    def test_streams_carry_the_credentials(self):
        # watch and events(follow=True) send the token as unary calls do:
        # a read token may follow, no credentials may not.
        job_id = self.submitter().submit(pending_spec("py-stream-token"))
        self.addCleanup(lambda: self.submitter().cancel(job_id))
        reader = self.client(token=READ_TOKEN)
        stream = reader.watch(job_id)
        self.assertEqual(next(stream).state, detour.JobState.PENDING)
        stream.close()
        history = reader.events(job_id, follow=True)
        self.assertEqual(next(history).kind, "client_action")  # "submitted by ..."
        history.close()
        with self.assertRaises(detour.Unauthenticated):
            next(self.client().watch(job_id))
        with self.assertRaises(detour.Unauthenticated):
            next(self.client().events(job_id, follow=True))

    def test_jobs_have_owners(self):
        alice = self.client(token=OWNER_TOKEN)
        job_id = alice.submit(pending_spec("py-owned"))
        self.addCleanup(lambda: alice.cancel(job_id))
        self.assertEqual(alice.get(job_id).owner, "py-alice")
        self.assertIn(job_id, [j.id for j in alice.list(owner="py-alice")])
        self.assertTrue(all(j.owner == "py-alice" for j in alice.list(owner="py-alice")))
        self.assertNotIn(job_id, [j.id for j in alice.list(owner="py-nobody")])
        # Another submitter may not cancel her job.
        with self.assertRaises(detour.PermissionDenied) as e:
            self.submitter().cancel(job_id)
        self.assertIn("py-alice", e.exception.message)
        with self.assertRaises(ValueError):
            alice.list(owner="x" * 129)

    def test_watch_until_succeeded(self):
        if not self.workers:
            self.skipTest("%s is not built (DETOUR_WITH_TORCH=OFF?): no job can run"
                          % binary(WORKER))
        c = self.submitter()
        job_id = c.submit(micro_spec("py-runs", 3))
        # The read role may watch.
        events = list(self.client(token=READ_TOKEN).watch(job_id, timeout=60))
        self.assertGreaterEqual(len(events), 2)
        self.assertTrue(all(isinstance(e, detour.JobEvent) for e in events))
        self.assertTrue(all(e.job.id == job_id for e in events))
        states = [e.state for e in events]
        self.assertEqual(states[-1], detour.JobState.SUCCEEDED, events[-1].job.message)
        self.assertTrue(all(not s.ended for s in states[:-1]), states)
        self.assertIn(detour.JobState.RUNNING, states)
        iterations = [e.progress.iteration for e in events]
        self.assertEqual(iterations, sorted(iterations))
        last = events[-1].progress
        self.assertEqual((last.iteration, last.total_iterations), (3, 3))
        self.assertGreater(last.loss, 0)
        self.assertGreater(last.tokens_per_s, 0)
        times = [e.time for e in events]
        self.assertEqual(times, sorted(times))

        job = c.get(job_id)
        self.assertTrue(job.succeeded)
        self.assertEqual(len(job.stages), 2)
        self.assertLessEqual(job.start_time, job.end_time)
        # An ended job: one event, wait() returns at once, cancel is refused.
        self.assertEqual([e.state for e in c.watch(job_id)], [detour.JobState.SUCCEEDED])
        self.assertEqual(c.wait(job_id, timeout=10).state, detour.JobState.SUCCEEDED)
        with self.assertRaises(detour.FailedPrecondition):
            c.cancel(job_id)
        self.assertEqual(list(c.events(job_id)), list(job.history))
        self.assertEqual(list(c.events(job_id, follow=True, timeout=10)), list(job.history))
        workers = c.workers()
        self.assertEqual(sorted(w.worker_id for w in workers), ["w0", "w1"])
        self.assertTrue(all(isinstance(w, detour.Worker) and w.region == "Oregon"
                            for w in workers))


class InsecureCoordinatorTest(ClusterTest):
    """A coordinator started with --insecure (and no --auth_tokens: open)."""

    @classmethod
    def setUpClass(cls):
        cls.make_dir()
        cls.coordinator = cls.start_coordinator(["--insecure"])
        cls.address = "127.0.0.1:%d" % cls.coordinator.port

    def test_plaintext(self):
        with detour.Client(self.address, insecure=True) as c:
            job_id = c.submit(pending_spec("py-plain"))
            self.assertEqual(c.get(job_id).state, detour.JobState.PENDING)
            self.assertIn(job_id, [j.id for j in c.list()])
            self.assertEqual(c.cancel(job_id).state, detour.JobState.CANCELLED)
            self.assertEqual(c.workers(), [])
        # The address from the environment, as detourctl.
        os.environ["DETOUR_COORDINATOR"] = self.address
        with detour.Client(insecure=True) as c:
            self.assertEqual(c.address, self.address)
            self.assertIn(job_id, [j.id for j in c.list("cancelled")])
        # TLS to a plaintext port fails the handshake; the hint says why.
        with self.assertRaises(detour.Unavailable) as e, \
                detour.Client(self.address, timeout=5) as c:
            c.list()
        self.assertIn("speaks plaintext HTTP/2", e.exception.hint)

    def test_a_name_finds_the_leader(self):
        """"localhost" (as a DNS name with an A record per coordinator would
        be) at a follower's port: the client follows it to the leader, where
        the follower's IP literal alone is refused as before."""
        follower = FakeFollower(self.address)
        self.addCleanup(follower.stop)
        with detour.Client("localhost:%d" % follower.port, insecure=True) as c:
            self.assertIsInstance(c.list(), list)
            self.assertEqual(c.address, self.address)
        self.assertGreaterEqual(follower.calls, 1)
        with detour.Client("127.0.0.1:%d" % follower.port, insecure=True) as c:
            with self.assertRaisesRegex(detour.Unavailable, "not the leader"):
                c.list()

    def test_command_line(self):
        spec = os.path.join(self.dir, "cli.json")
        with open(spec, "w", encoding="utf-8") as f:
            json.dump(pending_spec("py-cli"), f)

        def cli(*args):
            result = subprocess.run(
                [sys.executable, "-m", "detour", "--coordinator", self.address, "--insecure"] +
                list(args), capture_output=True, text=True, timeout=30, check=False)
            return result.returncode, result.stdout + result.stderr

        code, out = cli("submit", spec)
        self.assertEqual(code, 0, out)
        job_id = out.split()[-1]
        code, out = cli("--json", "get", job_id)
        self.assertEqual(code, 0, out)
        self.assertEqual(json.loads(out)["spec"]["name"], "py-cli")
        code, out = cli("cancel", job_id)
        self.assertEqual((code, out.strip()), (0, job_id + ": cancelled"))
        code, out = cli("get", "job-999999")
        self.assertEqual(code, 1, out)
        self.assertIn("NOT_FOUND", out)
        code, out = cli("submit", os.path.join(self.dir, "missing.json"))
        self.assertEqual(code, 2, out)
        result = subprocess.run([sys.executable, "-m", "detour", "--coordinator", self.address,
                                 "list"], capture_output=True, text=True, timeout=30, check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("give --tls_ca", result.stderr)


class WatchAcrossRestartTest(ClusterTest):
    """watch() follows a job through a coordinator killed and started again."""

    @classmethod
    def setUpClass(cls):
        cls.make_dir()
        cls.coordinator = cls.start_coordinator(["--insecure"])
        cls.address = "127.0.0.1:%d" % cls.coordinator.port

    def restart(self):
        """SIGKILL, then the same coordinator (data, port) again."""
        old = self.coordinator
        old.process.kill()
        old.process.wait(timeout=30)
        type(self).coordinator = self.start("coordinator-again", [
            binary(COORDINATOR), "--listen=" + self.address, "--metrics_port=0",
            "--metrics_bind=127.0.0.1", "--data_dir=" + os.path.join(self.dir, "coordinator"),
            "--worker_silence=1500ms", "--heartbeat_interval=200ms", "--insecure"])

    def test_watch_reconnects_and_repeats_nothing(self):
        c = detour.Client(self.address, insecure=True)
        self.addCleanup(c.close)
        job_id = c.submit(pending_spec("py-restart"))
        # The timeout keeps a broken reconnection from hanging the test.
        stream = c.watch(job_id, timeout=120, reconnect_for=90)
        events = [next(stream)]
        self.assertEqual(events[0].state, detour.JobState.PENDING)
        failures = []

        def restart_and_cancel():
            try:
                self.restart()
                with detour.Client(self.address, insecure=True) as other:
                    other.cancel(job_id)
            except Exception as e:  # pylint: disable=broad-except
                failures.append(e)

        thread = threading.Thread(target=restart_and_cancel)
        with self.assertLogs("detour", "WARNING") as logs:
            thread.start()
            try:
                events.extend(stream)
            finally:
                thread.join(timeout=120)
        self.assertEqual(failures, [])
        self.assertEqual(events[-1].state, detour.JobState.CANCELLED, events[-1].job.message)
        self.assertTrue(all(not e.job.ended for e in events[:-1]))
        for before, after in zip(events, events[1:]):
            self.assertNotEqual(before.job.proto, after.job.proto)  # nothing repeated
        self.assertTrue(any("reconnecting in" in line and job_id in line for line in logs.output),
                        logs.output)
        # The history continues across the restart: each event once.
        history = list(c.events(job_id, follow=True, timeout=30))
        self.assertEqual(len(history), len(set((e.time, e.message) for e in history)))
        self.assertTrue(any("cancelled" in e.message for e in history), history)

    def test_gives_up_after_reconnect_for(self):
        c = detour.Client("127.0.0.1:1", insecure=True)
        self.addCleanup(c.close)
        # Never reached: at once, not after reconnect_for.
        start = time.monotonic()
        with self.assertRaises(detour.Unavailable):
            next(c.watch("job-000001", reconnect_for=60))
        self.assertLess(time.monotonic() - start, 30)
        with self.assertRaises(ValueError):
            c.watch("job-000001", reconnect_for=-1)


def main():
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--source_dir", default="")
    parser.add_argument("--build_dir", default="")
    args, rest = parser.parse_known_args()
    global SOURCE_DIR, BUILD_DIR  # pylint: disable=global-statement
    SOURCE_DIR = os.environ.get("DETOUR_SOURCE_DIR") or args.source_dir
    BUILD_DIR = os.environ.get("DETOUR_BUILD_DIR") or args.build_dir
    if not SOURCE_DIR or not BUILD_DIR:
        sys.exit("client_test.py: give --source_dir and --build_dir (or set "
                 "DETOUR_SOURCE_DIR and DETOUR_BUILD_DIR)")
    unittest.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    main()
