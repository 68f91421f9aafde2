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

import ipaddress
import logging
import os
import socket
import stat
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import grpc

from detour._proto.detour.v1 import control_service_pb2
from detour._proto.detour.v1 import control_service_pb2_grpc
from detour._proto.detour.v1 import job_service_pb2
from detour._proto.detour.v1 import job_service_pb2_grpc
from detour._probe import port_hint, probe_port
from detour.errors import (ConfigError, DeadlineExceeded, DetourError, InvalidArgument,
                           Unavailable, from_rpc_error)
from detour.jobs import HistoryEvent, Job, JobEvent, JobState, Worker
from detour.spec import SpecLike, load_spec

__all__ = ["Client", "DEFAULT_ADDRESS", "DEFAULT_TIMEOUT", "DEFAULT_RECONNECT_FOR"]

# What detourctl uses without --coordinator and $DETOUR_COORDINATOR.
DEFAULT_ADDRESS = "127.0.0.1:7070"
# Seconds each unary call may take (detourctl's --timeout default).
DEFAULT_TIMEOUT = 10.0
# Seconds a broken watch keeps reconnecting (detourctl's --reconnect_for).
DEFAULT_RECONNECT_FOR = 300.0
_MAX_RECONNECT_FOR = 24 * 3600.0
_FIRST_BACKOFF = 0.2
_MAX_BACKOFF = 5.0

# Reconnection notes of watch() go here (WARNING): to stderr unless the
# program configures logging otherwise.
_log = logging.getLogger("detour")

_MAX_TOKEN_CHARS = 512
_MAX_PEM_BYTES = 1 << 20
_MAX_MESSAGE_BYTES = 64 << 20  # as the daemons' channels (common/net/server.h)
_MAX_LIST_PAGES = 100000
_MAX_ADDRESSES = 16
# The trailing metadata a follower names the leader in (UNAVAILABLE).
LEADER_METADATA = "detour-leader"
# At most this long is spent finding out what answers at an unreachable
# coordinator's address (the hint of Unavailable and DeadlineExceeded).
_PROBE_SECONDS = 2.0

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


def _valid_address(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return (bool(sep) and bool(host) and len(address) <= 256 and port.isdigit() and
            0 < int(port) < 65536)


def _parse_addresses(address: str) -> List[str]:
    """host:port[,host:port...], duplicates dropped; one address may be any
    gRPC target (as before several were accepted)."""
    if "," not in address:
        return [address.strip()]
    addresses: List[str] = []
    for part in address.split(","):
        part = part.strip()
        if not _valid_address(part):
            raise ConfigError("address: %r in %r is not host:port" % (part, address[:256]))
        if part not in addresses:
            addresses.append(part)
    if len(addresses) > _MAX_ADDRESSES:
        raise ConfigError("address: more than %d coordinators" % _MAX_ADDRESSES)
    return addresses


def _host_name(address: str) -> Optional[str]:
    """The host of `address` when it is host:port with a DNS name for host
    (not an IP literal, not another kind of gRPC target); else None."""
    if not _valid_address(address):
        return None
    host = address.rpartition(":")[0]
    if host.startswith("[") or ":" in host or "/" in host:
        return None
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        return host


def _resolve(host: str, port: int) -> List[str]:
    """Every address `host` resolves to (IPv4 and IPv6, in the resolver's
    order, duplicates dropped) as host:port; [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    addresses: List[str] = []
    for family, _, _, _, sockaddr in infos:
        if family == socket.AF_INET:
            address = "%s:%d" % (sockaddr[0], port)
        elif family == socket.AF_INET6:
            address = "[%s]:%d" % (sockaddr[0], port)
        else:
            continue
        if address not in addresses:
            addresses.append(address)
    return addresses[:_MAX_ADDRESSES]


def _check_token(token: str, source: str) -> str:
    if not isinstance(token, str):
        raise ConfigError("%s: a token is a str, not %s" % (source, type(token).__name__))
    if not (0 < len(token) <= _MAX_TOKEN_CHARS) or any(c <= " " or c >= "\x7f" for c in token):
        raise ConfigError("%s: a token is 1..%d printable ASCII characters without spaces"
                          % (source, _MAX_TOKEN_CHARS))
    return token


def _check_private(name: str) -> None:
    """Refuses a token file others may read or change, as ssh refuses such
    keys: when this user owns it and any group or other bit is set. A file
    owned by someone else (root, readable through a group, as a Kubernetes
    Secret is mounted) is left to its owner."""
    try:
        st = os.stat(name)
    except OSError as e:
        raise ConfigError("token_file: cannot read %s: %s" % (name, e.strerror or e)) from None
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        raise ConfigError("token_file: %s has mode %04o: others may read or change this secret, "
                          "so it is refused (as ssh refuses such keys); run: chmod 600 %s"
                          % (name, stat.S_IMODE(st.st_mode), name))


def _load_token(token: Optional[str], token_file: Optional[PathLike]) -> Optional[str]:
    """The bearer token: `token`, else the only word of `token_file`, else $DETOUR_TOKEN."""
    if token is not None and token_file is not None:
        raise ConfigError("give token or token_file, not both")
    if token is not None:
        return _check_token(token, "token")
    if token_file is not None:
        name = os.path.expanduser(os.fspath(token_file))
        _check_private(name)
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
            $DETOUR_COORDINATOR, else 127.0.0.1:7070. Several comma-separated
            (coordinators electing a leader over etcd): calls go to the
            leader, found by following a follower's redirection (its
            UNAVAILABLE names the leader in the ``detour-leader`` trailing
            metadata), else by trying the next address; at most two rounds
            over the list per call. A single address whose host is a DNS
            name (not an IP literal), e.g. one name with an A record per
            coordinator, is looked up here (socket.getaddrinfo) and its
            addresses are treated as that list: the leader is found among
            them, following redirections, as above. A name that does not
            resolve is kept as it is (the first call fails UNAVAILABLE).
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
            against, when it is not the host in `address`. For the
            addresses a DNS name resolved to it defaults to that name; a
            leader named by a follower's redirection is verified against
            its own host.
        timeout: seconds each unary call may take; None for no limit.
            Streams (watch, events with follow) have no limit by default.

    Raises:
        ConfigError: unreadable or non-PEM files, a malformed token, or
            contradictory settings. Nothing is sent until the first call
            (but for the DNS lookup of a single name).
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
        self._addresses = _parse_addresses(address)
        # The addresses a single DNS name resolved to, and the name their
        # certificates are verified against.
        self._names: Dict[str, str] = {}
        host = _host_name(self._addresses[0]) if len(self._addresses) == 1 else None
        if host is not None:
            resolved = _resolve(host, int(self._addresses[0].rpartition(":")[2]))
            if resolved:
                self._addresses = resolved
                self._names = {a: host for a in resolved}
        # Whether the leader is looked for (several addresses, or a name).
        self._several = len(self._addresses) > 1 or bool(self._names)
        self.address = self._addresses[0]
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
            self._credentials: Optional[grpc.ChannelCredentials] = None
        else:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(ca, "ca", "CERTIFICATE") if ca is not None else None,
                private_key=_read_pem(key, "key", "PRIVATE KEY") if key is not None else None,
                certificate_chain=(_read_pem(cert, "cert", "CERTIFICATE")
                                   if cert is not None else None))
            if server_name is not None:
                options.append(("grpc.ssl_target_name_override", server_name))
                self._names = {}
            self._credentials = credentials
        self._options = options
        self.insecure = insecure
        self._closed = False
        self._located = not self._several
        self._connect(self.address)

    def _connect(self, address: str) -> None:
        """Opens the channel to `address` (closing the one before)."""
        old = getattr(self, "_channel", None)
        if self._credentials is None:
            self._channel = grpc.insecure_channel(address, options=self._options)
        else:
            options = self._options
            if address in self._names:
                options = options + [("grpc.ssl_target_name_override", self._names[address])]
            self._channel = grpc.secure_channel(address, self._credentials, options=options)
        if old is not None:
            old.close()
        self.address = address
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
        job = self._unary("submit", "_jobs", "Submit", request, timeout, spec=True)
        return str(job.id)

    def get(self, job_id: str, *, timeout: Optional[float] = None) -> Job:
        """The job with this id. Raises NotFound for an unknown id."""
        request = job_service_pb2.GetJobRequest(job_id=_check_job_id(job_id))
        return Job.from_proto(self._unary("get", "_jobs", "Get", request, timeout))

    def list(self, state: Optional[Union[JobState, str, int]] = None, *,
             owner: Optional[str] = None, page_size: int = 0,
             timeout: Optional[float] = None) -> List[Job]:
        """Every job (or those in `state`, of `owner`), newest first; follows all pages."""
        return list(self.iter_jobs(state, owner=owner, page_size=page_size, timeout=timeout))

    def iter_jobs(self, state: Optional[Union[JobState, str, int]] = None, *,
                  owner: Optional[str] = None, page_size: int = 0,
                  timeout: Optional[float] = None) -> Iterator[Job]:
        """Like list(), one page at a time: asks for the next page when needed.

        `owner` keeps the jobs of one submitter (Job.owner: a token's name or
        a client certificate's CN; at most 128 characters). `page_size` is
        the most jobs per answer (0: the coordinator's 100). `timeout`
        applies to each page.
        """
        request = job_service_pb2.ListJobsRequest()
        if owner is not None:
            if not isinstance(owner, str):
                raise TypeError("owner: expected a str, not %s" % type(owner).__name__)
            if not owner or len(owner) > 128:
                raise ValueError("owner: expected 1..128 characters, got %d" % len(owner))
            request.owner = owner
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
            page = self._unary("list", "_jobs", "List", request, timeout)
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
        return Job.from_proto(self._unary("cancel", "_jobs", "Cancel", request, timeout))

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
        return Job.from_proto(self._unary("resume", "_jobs", "Resume", request, timeout))

    def watch(self, job_id: str, *, timeout: Optional[float] = None,
              reconnect_for: Optional[float] = DEFAULT_RECONNECT_FOR) -> Iterator[JobEvent]:
        """Follows a job: one JobEvent per change, the first a snapshot.

        The iterator ends after the event in which the job has ended (its
        state is SUCCEEDED, FAILED or CANCELLED); errors (NotFound,
        Unavailable, ...) are raised from the iteration. `timeout` bounds
        the whole watch (DeadlineExceeded); default none, as jobs run for
        hours. Stopping early (break, close()) cancels the stream.

        A stream that breaks after its first event (UNAVAILABLE or
        CANCELLED: the coordinator restarted, paused past the keep-alive or
        failed over) is opened again, with a back-off from 0.2 s doubling
        to 5 s, for at most `reconnect_for` seconds since the last event
        (None or 0: never);
        each attempt is logged as a warning on the "detour" logger (stderr
        by default), and giving up raises Unavailable. A reconnection's
        first snapshot is skipped when it equals the last event yielded, so
        no event repeats; what changed meanwhile arrives as one snapshot.
        """
        request = job_service_pb2.WatchJobRequest(job_id=_check_job_id(job_id))
        if reconnect_for is not None and (isinstance(reconnect_for, bool) or
                                          not isinstance(reconnect_for, (int, float)) or
                                          not 0 <= reconnect_for <= _MAX_RECONNECT_FOR):
            raise ValueError("reconnect_for: expected seconds in 0..%d or None, got %r"
                             % (_MAX_RECONNECT_FOR, reconnect_for))
        self._check_open("watch")
        self._locate()
        return self._follow(request, timeout, float(reconnect_for or 0), "watch")

    def wait(self, job_id: str, *, timeout: Optional[float] = None,
             reconnect_for: Optional[float] = DEFAULT_RECONNECT_FOR) -> Job:
        """Blocks until the job ends; returns it in its final state."""
        last: Optional[JobEvent] = None
        for last in self.watch(job_id, timeout=timeout, reconnect_for=reconnect_for):
            pass
        assert last is not None  # watch ends only after an ended job or an error
        return last.job

    def events(self, job_id: str, *, follow: bool = False, timeout: Optional[float] = None,
               reconnect_for: Optional[float] = DEFAULT_RECONNECT_FOR
               ) -> Iterator[HistoryEvent]:
        """The job's elastic-training history (workers lost, rerouted, joined, ...).

        Without `follow`, the recorded events (the newest 200), oldest first.
        With it, those and then each new one as it happens, until the job
        ends (the events come from watch(); `timeout` and `reconnect_for` as
        there: after a reconnection the events continue after the last one
        yielded, none repeated, none left out while the record still holds
        them).
        """
        if not follow:
            return iter(self.get(job_id, timeout=timeout).history)
        return self._new_history(self.watch(job_id, timeout=timeout,
                                            reconnect_for=reconnect_for))

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
        response = self._unary("workers", "_control", "ListWorkers", request, timeout)
        return [Worker.from_proto(w) for w in response.workers]

    # -- plumbing ----------------------------------------------------------

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise DetourError("the client is closed", method=method)

    def _unary(self, method: str, service: str, rpc: str, request: Any,
               timeout: Optional[float], *, spec: bool = False) -> Any:
        self._check_open(method)
        tries = 2 * len(self._addresses) + 2 if self._several else 1
        for attempt in range(tries):
            stub_method = getattr(getattr(self, service), rpc)
            try:
                result = stub_method(request,
                                     timeout=timeout if timeout is not None else self.timeout,
                                     metadata=self._metadata)
                self._located = True
                return result
            except grpc.RpcError as e:
                if attempt + 1 == tries or not self._next_coordinator(e):
                    raise self._with_hint(from_rpc_error(e, method, spec=spec)) from e
            except ValueError as e:  # gRPC's answer for a channel closed meanwhile
                raise DetourError(str(e), method=method) from e
        raise AssertionError("unreachable")  # pragma: no cover

    def _with_hint(self, error: DetourError) -> DetourError:
        """`error`, with a hint when the coordinator was unreachable and what
        answers at its address is recognisable (a metrics port, TLS against
        plaintext or the reverse)."""
        if isinstance(error, (Unavailable, DeadlineExceeded)):
            seconds = min(self.timeout or _PROBE_SECONDS, _PROBE_SECONDS)
            error.hint = port_hint(self.address, not self.insecure,
                                   probe_port(self.address, seconds))
        return error

    def _next_coordinator(self, error: grpc.RpcError) -> bool:
        """After a failed call: moves to the leader a follower named, or to the
        next address, when the error says this coordinator cannot serve.
        Returns whether to retry."""
        code = error.code() if hasattr(error, "code") else None
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return False
        leader = None
        trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        for key, value in trailers or ():
            if key == LEADER_METADATA and isinstance(value, str) and _valid_address(value):
                leader = value
        if leader is not None and leader != self.address:
            self._connect(leader)
            return True
        index = self._addresses.index(self.address) if self.address in self._addresses else -1
        self._connect(self._addresses[(index + 1) % len(self._addresses)])
        return True

    def _locate(self) -> None:
        """Before a stream: with several addresses, finds the leader with a
        cheap call (Get of no job answers INVALID_ARGUMENT on the leader)."""
        if self._located:
            return
        try:
            self._unary("locate", "_jobs", "Get", job_service_pb2.GetJobRequest(), None)
        except InvalidArgument:
            self._located = True

    def _follow(self, request: job_service_pb2.WatchJobRequest, timeout: Optional[float],
                reconnect_for: float, method: str) -> Iterator[JobEvent]:
        deadline = None if timeout is None else time.monotonic() + timeout
        last: Optional[job_service_pb2.Job] = None
        broken_since: Optional[float] = None
        backoff = _FIRST_BACKOFF
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            call = self._jobs.Watch(request, timeout=remaining, metadata=self._metadata)
            error: Optional[grpc.RpcError] = None
            try:
                for message in call:
                    broken_since, backoff = None, _FIRST_BACKOFF
                    if last is not None and message.job == last:
                        continue  # a reconnection's snapshot of what was seen
                    last = message.job
                    yield JobEvent.from_proto(message)
            except grpc.RpcError as e:
                error = e
            finally:
                call.cancel()  # a no-op once the stream ended; else stops it
            if error is None and last is not None and JobState.parse(last.state).ended:
                return
            code = error.code() if error is not None else grpc.StatusCode.UNAVAILABLE
            # CANCELLED is the server's doing unless this client was closed:
            # a coordinator shutting down cancels a stream it had not yet
            # registered (one that had just reconnected).
            broke = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            if not broke or last is None or not reconnect_for or self._closed:
                if error is not None:
                    raise from_rpc_error(error, method) from error
                raise Unavailable("the coordinator ended the stream before the job ended%s"
                                  % ("" if last is None else " (last state %s)"
                                     % JobState.parse(last.state)), method=method)
            why = (error.details() if error is not None and hasattr(error, "details") else
                   "the coordinator ended the stream before the job ended")
            now = time.monotonic()
            if broken_since is None:
                broken_since = now
            left = broken_since + reconnect_for - now
            if deadline is not None:
                left = min(left, deadline - now)
            if left <= 0:
                raise Unavailable("gave up after %.0f s reconnecting to the coordinator %s "
                                  "(reconnect_for=%g): %s"
                                  % (now - broken_since, self.address, reconnect_for, why),
                                  method=method)
            wait = min(backoff, left)
            _log.warning("%s %s: the stream from the coordinator %s broke (%s); reconnecting "
                         "in %.1f s (gives up in %.0f s)", method, request.job_id, self.address,
                         why, wait, left)
            time.sleep(wait)  # the back-off itself
            backoff = min(2 * backoff, _MAX_BACKOFF)
            if self._several:
                self._located = False
                try:
                    self._locate()
                except DetourError:
                    pass  # the next attempt fails and backs off again
