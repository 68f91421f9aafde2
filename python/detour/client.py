"""The coordinator's JobService (and ListWorkers) for Python programs.

    with detour.Client("coordinator.example:7070", ca="ca.crt",
                       token_file="~/.detour/token") as client:
        job_id = client.submit("examples/jobs/tiny_local.json")
        for event in client.watch(job_id):
            print(event.state, event.progress.iteration, event.progress.loss)

A Client owns one gRPC channel. It is thread-safe (gRPC channels and stubs
are), and close() or leaving the ``with`` block closes the channel; calls
after that raise DetourError.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple, Union

import grpc

from detour._proto.detour.v1 import control_service_pb2
from detour._proto.detour.v1 import control_service_pb2_grpc
from detour._proto.detour.v1 import job_service_pb2
from detour._proto.detour.v1 import job_service_pb2_grpc
from detour.errors import (ConfigError, DetourError, InvalidArgument, Unavailable,
                           from_rpc_error)
from detour.jobs import HistoryEvent, Job, JobEvent, JobState, Worker
from detour.spec import SpecLike, load_spec

__all__ = ["Client", "DEFAULT_ADDRESS", "DEFAULT_TIMEOUT"]

# What detourctl uses without --coordinator and $DETOUR_COORDINATOR.
DEFAULT_ADDRESS = "127.0.0.1:7070"
# Seconds each unary call may take (detourctl's --timeout default).
DEFAULT_TIMEOUT = 10.0

_MAX_TOKEN_CHARS = 512
_MAX_PEM_BYTES = 1 << 20
_MAX_MESSAGE_BYTES = 64 << 20  # as the daemons' channels (common/net/server.h)
_MAX_LIST_PAGES = 100000

PathLike = Union[str, "os.PathLike[str]"]


def _read_pem(path: PathLike, what: str, marker: str) -> bytes:
    name = os.path.expanduser(os.fspath(path))
    try:
        with open(name, "rb") as f:
            data = f.read(_MAX_PEM_BYTES + 1)
    except OSError as e:
        raise ConfigError("%s: cannot read %s: %s" % (what, name, e.strerror or e)) from None
    if len(data) > _MAX_PEM_BYTES:
        raise ConfigError("%s: %s is larger than %d bytes" % (what, name, _MAX_PEM_BYTES))
    if b"-----BEGIN " not in data or marker.encode() not in data:
        raise ConfigError("%s: %s holds no PEM %s" % (what, name, marker.lower()))
    return data


def _check_token(token: str, source: str) -> str:
    if not isinstance(token, str):
        raise ConfigError("%s: a token is a str, not %s" % (source, type(token).__name__))
    if not (0 < len(token) <= _MAX_TOKEN_CHARS) or any(c <= " " or c >= "\x7f" for c in token):
        raise ConfigError("%s: a token is 1..%d printable ASCII characters without spaces"
                          % (source, _MAX_TOKEN_CHARS))
    return token


def _load_token(token: Optional[str], token_file: Optional[PathLike]) -> Optional[str]:
    """The bearer token: `token`, else the only word of `token_file`, else $DETOUR_TOKEN."""
    if token is not None and token_file is not None:
        raise ConfigError("give token or token_file, not both")
    if token is not None:
        return _check_token(token, "token")
    if token_file is not None:
        name = os.path.expanduser(os.fspath(token_file))
        try:
            with open(name, "r", encoding="utf-8") as f:
                text = f.read(_MAX_TOKEN_CHARS + 4096)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("token_file: cannot read %s: %s" % (name, e)) from None
        return _check_token(text.strip(), "token_file %s" % name)
    env = os.environ.get("DETOUR_TOKEN")
    if env:
        return _check_token(env, "$DETOUR_TOKEN")
    return None


def _check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str):
        raise TypeError("a job id is a str, not %s" % type(job_id).__name__)
    if not job_id:
        raise InvalidArgument("job_id: required")
    return job_id


class Client:
    """A connection to a detour coordinator.

    Args:
        address: host:port of the coordinator (any gRPC target); default
            $DETOUR_COORDINATOR, else 127.0.0.1:7070.
        ca: PEM file of the CA the coordinator's certificate must chain to
            (the cluster CA, e.g. from tools/gen_certs.sh). None: the
            system's trusted roots.
        cert, key: PEM client certificate and its key, both or neither. A
            coordinator with --auth_tokens gives a certificate the role of
            the token entry named by its CN; one without accepts any
            certificate from its CA with the submit role.
        token: bearer token, sent as ``authorization: Bearer TOKEN``.
        token_file: a file whose only word is the token (instead of token).
            Without either, $DETOUR_TOKEN when set.
        insecure: plaintext, for a coordinator started with --insecure.
            Refused together with ca, cert or key.
        server_name: the name to verify the coordinator's certificate
            against, when it is not the host in `address`.
        timeout: seconds each unary call may take; None for no limit.
            Streams (watch, events with follow) have no limit by default.

    Raises:
        ConfigError: unreadable or non-PEM files, a malformed token, or
            contradictory settings. Nothing is sent until the first call.
    """

    def __init__(self, address: Optional[str] = None, *, ca: Optional[PathLike] = None,
                 cert: Optional[PathLike] = None, key: Optional[PathLike] = None,
                 token: Optional[str] = None, token_file: Optional[PathLike] = None,
                 insecure: bool = False, server_name: Optional[str] = None,
                 timeout: Optional[float] = DEFAULT_TIMEOUT) -> None:
        if address is None:
            address = os.environ.get("DETOUR_COORDINATOR") or DEFAULT_ADDRESS
        if not isinstance(address, str) or not address.strip():
            raise ConfigError("address: expected host:port, got %r" % (address,))
        if timeout is not None and (isinstance(timeout, bool) or
                                    not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ConfigError("timeout: expected a positive number of seconds or None, got %r"
                              % (timeout,))
        if (cert is None) != (key is None):
            raise ConfigError("cert and key go together: give both or neither")
        self.address = address
        self.timeout = timeout
        self._token = _load_token(token, token_file)
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", "Bearer " + self._token),) if self._token else ())
        options: List[Tuple[str, Union[int, str]]] = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 20000),
            ("grpc.keepalive_timeout_ms", 10000),
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.initial_reconnect_backoff_ms", 200),
        ]
        if insecure:
            given = [n for n, v in (("ca", ca), ("cert", cert), ("key", key),
                                    ("server_name", server_name)) if v is not None]
            if given:
                raise ConfigError("insecure=True contradicts %s: plaintext has no certificates"
                                  % ", ".join(given))
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(ca, "ca", "CERTIFICATE") if ca is not None else None,
                private_key=_read_pem(key, "key", "PRIVATE KEY") if key is not None else None,
                certificate_chain=(_read_pem(cert, "cert", "CERTIFICATE")
                                   if cert is not None else None))
            if server_name is not None:
                options.append(("grpc.ssl_target_name_override", server_name))
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self.insecure = insecure
        self._closed = False
        # The generated stubs carry no annotations.
        self._jobs = job_service_pb2_grpc.JobServiceStub(  # type: ignore[no-untyped-call]
            self._channel)
        self._control = control_service_pb2_grpc.ControlServiceStub(  # type: ignore[no-untyped-call]
            self._channel)

    # -- lifetime ----------------------------------------------------------

    def close(self) -> None:
        """Closes the channel; running watches end with an error. Idempotent."""
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Client(%r, %s%s)" % (self.address, "insecure" if self.insecure else "TLS",
                                     ", closed" if self._closed else "")

    # -- jobs --------------------------------------------------------------

    def submit(self, spec: SpecLike, *, timeout: Optional[float] = None) -> str:
        """Submits a job; returns its id (e.g. "job-000001").

        `spec` is a dict in the JSON form of detour.v1.JobSpec, the path of
        such a JSON file (what ``detourctl submit`` takes), or a JobSpec.

        Raises:
            InvalidSpec: the spec does not parse, or the coordinator refused
                it; ``field`` names the offending field.
            PermissionDenied: the credentials only have the read role.
        """
        request = job_service_pb2.SubmitJobRequest(spec=load_spec(spec))
        job = self._unary("submit", self._jobs.Submit, request, timeout, spec=True)
        return str(job.id)

    def get(self, job_id: str, *, timeout: Optional[float] = None) -> Job:
        """The job with this id. Raises NotFound for an unknown id."""
        request = job_service_pb2.GetJobRequest(job_id=_check_job_id(job_id))
        return Job.from_proto(self._unary("get", self._jobs.Get, request, timeout))

    def list(self, state: Optional[Union[JobState, str, int]] = None, *,
             page_size: int = 0, timeout: Optional[float] = None) -> List[Job]:
        """Every job (or those in `state`), newest first; follows all pages."""
        return list(self.iter_jobs(state, page_size=page_size, timeout=timeout))

    def iter_jobs(self, state: Optional[Union[JobState, str, int]] = None, *,
                  page_size: int = 0, timeout: Optional[float] = None) -> Iterator[Job]:
        """Like list(), one page at a time: asks for the next page when needed.

        `page_size` is the most jobs per answer (0: the coordinator's 100).
        `timeout` applies to each page.
        """
        request = job_service_pb2.ListJobsRequest()
        if state is not None:
            parsed = JobState.parse(state)
            if parsed == JobState.UNSPECIFIED:
                raise ValueError("state: give a job state, or None for all jobs")
            request.state = job_service_pb2.JobState.Value("JOB_STATE_" + parsed.name)
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 0:
            raise ValueError("page_size: expected a non-negative int, got %r" % (page_size,))
        request.page_size = page_size
        return self._pages(request, timeout)

    def _pages(self, request: job_service_pb2.ListJobsRequest,
               timeout: Optional[float]) -> Iterator[Job]:
        seen = set()
        for _ in range(_MAX_LIST_PAGES):
            page = self._unary("list", self._jobs.List, request, timeout)
            for job in page.jobs:
                yield Job.from_proto(job)
            if not page.next_page_token:
                return
            if page.next_page_token in seen:
                break
            seen.add(page.next_page_token)
            request.page_token = page.next_page_token
        raise DetourError("the coordinator's pages do not end (token %r repeats)"
                          % request.page_token, method="list")

    def cancel(self, job_id: str, *, timeout: Optional[float] = None) -> Job:
        """Cancels a job that has not ended; returns it (CANCELLED).

        Raises FailedPrecondition when it has ended, NotFound for an unknown
        id, PermissionDenied for read-only credentials.
        """
        request = job_service_pb2.CancelJobRequest(job_id=_check_job_id(job_id))
        return Job.from_proto(self._unary("cancel", self._jobs.Cancel, request, timeout))

    def resume(self, job_id: str, checkpoint: str = "", *, replicas_per_stage: int = 0,
               timeout: Optional[float] = None) -> Job:
        """Restarts a FAILED or CANCELLED job from a checkpoint (default its newest).

        The job becomes PENDING again under its id, with ``replicas_per_stage``
        replicas per stage (0: its own). Raises FailedPrecondition when it has
        not ended, succeeded, or has no checkpoint.
        """
        if not isinstance(checkpoint, str):
            raise TypeError("checkpoint: expected a str, not %s" % type(checkpoint).__name__)
        if (not isinstance(replicas_per_stage, int) or isinstance(replicas_per_stage, bool)
                or not 0 <= replicas_per_stage <= 1024):
            raise ValueError("replicas_per_stage: expected an int in 0..1024, not %r"
                             % (replicas_per_stage,))
        request = job_service_pb2.ResumeJobRequest(job_id=_check_job_id(job_id),
                                                   checkpoint=checkpoint,
                                                   replicas_per_stage=replicas_per_stage)
        return Job.from_proto(self._unary("resume", self._jobs.Resume, request, timeout))

    def watch(self, job_id: str, *, timeout: Optional[float] = None) -> Iterator[JobEvent]:
        """Follows a job: one JobEvent per change, the first a snapshot.

        The iterator ends after the event in which the job has ended (its
        state is SUCCEEDED, FAILED or CANCELLED); errors (NotFound,
        Unavailable, ...) are raised from the iteration. `timeout` bounds
        the whole watch (DeadlineExceeded); default none, as jobs run for
        hours. Stopping early (break, close()) cancels the stream.
        """
        request = job_service_pb2.WatchJobRequest(job_id=_check_job_id(job_id))
        self._check_open("watch")
        call = self._jobs.Watch(request, timeout=timeout, metadata=self._metadata)
        return self._follow(call, "watch")

    def wait(self, job_id: str, *, timeout: Optional[float] = None) -> Job:
        """Blocks until the job ends; returns it in its final state."""
        last: Optional[JobEvent] = None
        for last in self.watch(job_id, timeout=timeout):
            pass
        assert last is not None  # watch ends only after an ended job or an error
        return last.job

    def events(self, job_id: str, *, follow: bool = False,
               timeout: Optional[float] = None) -> Iterator[HistoryEvent]:
        """The job's elastic-training history (workers lost, rerouted, joined, ...).

        Without `follow`, the recorded events (the newest 200), oldest first.
        With it, those and then each new one as it happens, until the job
        ends (the events come from watch(); `timeout` as there).
        """
        if not follow:
            return iter(self.get(job_id, timeout=timeout).history)
        return self._new_history(self.watch(job_id, timeout=timeout))

    @staticmethod
    def _new_history(events: Iterable[JobEvent]) -> Iterator[HistoryEvent]:
        last: Optional[HistoryEvent] = None
        for event in events:
            history = event.job.history
            start = 0
            if last is not None:
                # The record keeps the newest 200: find where we left off.
                start = next((i + 1 for i in range(len(history) - 1, -1, -1)
                              if history[i] == last), 0)
            for e in history[start:]:
                yield e
            if history:
                last = history[-1]

    # -- workers -----------------------------------------------------------

    def workers(self, *, include_lost: bool = False,
                timeout: Optional[float] = None) -> List[Worker]:
        """The registered workers (role read); with `include_lost` those marked lost too."""
        request = control_service_pb2.ListWorkersRequest(include_lost=bool(include_lost))
        response = self._unary("workers", self._control.ListWorkers, request, timeout)
        return [Worker.from_proto(w) for w in response.workers]

    # -- plumbing ----------------------------------------------------------

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise DetourError("the client is closed", method=method)

    def _unary(self, method: str, stub_method: Callable[..., Any], request: Any,
               timeout: Optional[float], *, spec: bool = False) -> Any:
        self._check_open(method)
        try:
            return stub_method(request, timeout=timeout if timeout is not None else self.timeout,
                               metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, method, spec=spec) from e
        except ValueError as e:  # gRPC's answer for a channel closed meanwhile
            raise DetourError(str(e), method=method) from e

    @staticmethod
    def _follow(call: Any, method: str) -> Iterator[JobEvent]:
        last: Optional[JobEvent] = None
        try:
            for message in call:
                last = JobEvent.from_proto(message)
                yield last
        except grpc.RpcError as e:
            raise from_rpc_error(e, method) from e
        finally:
            call.cancel()  # a no-op once the stream ended; else stops it
        if last is None or not last.job.ended:
            raise Unavailable("the coordinator ended the stream before the job ended%s"
                              % ("" if last is None else " (last state %s)" % last.state),
                              method=method)
