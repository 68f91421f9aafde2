"""Typed, read-only views of what the coordinator answers.

Each class mirrors one message of ``proto/detour/v1/job_service.proto`` or
``control_service.proto`` (see the comments there for units and meanings)
and keeps the original message in ``proto`` for anything not copied out.
Times are timezone-aware UTC datetimes, or None where the coordinator has
not set them.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from google.protobuf import json_format
from google.protobuf import timestamp_pb2

from detour._proto.detour.v1 import control_service_pb2
from detour._proto.detour.v1 import job_service_pb2
from detour._proto.detour.v1 import spec_pb2

__all__ = ["JobState", "Progress", "HistoryEvent", "Job", "JobEvent", "Worker"]


class JobState(enum.IntEnum):
    """A job's state; the values are those of ``detour.v1.JobState``."""

    UNSPECIFIED = job_service_pb2.JOB_STATE_UNSPECIFIED
    PENDING = job_service_pb2.JOB_STATE_PENDING
    ASSIGNING = job_service_pb2.JOB_STATE_ASSIGNING
    RUNNING = job_service_pb2.JOB_STATE_RUNNING
    SUCCEEDED = job_service_pb2.JOB_STATE_SUCCEEDED
    FAILED = job_service_pb2.JOB_STATE_FAILED
    CANCELLED = job_service_pb2.JOB_STATE_CANCELLED

    @property
    def ended(self) -> bool:
        """SUCCEEDED, FAILED or CANCELLED: the job will not change any more."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: Union["JobState", str, int]) -> "JobState":
        """A state from a JobState, its name ("running", "JOB_STATE_RUNNING") or number."""
        if isinstance(value, JobState):
            return value
        if isinstance(value, bool):
            raise TypeError("a job state is a JobState, a name or a number, not a bool")
        if isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                raise ValueError("%d is not a job state number" % value) from None
        if isinstance(value, str):
            name = value.strip().upper()
            if name.startswith("JOB_STATE_"):
                name = name[len("JOB_STATE_"):]
            if name in cls.__members__ and name != "UNSPECIFIED":
                return cls[name]
            raise ValueError("%r is not a job state (one of: %s)" % (
                value, ", ".join(str(s) for s in cls if s != JobState.UNSPECIFIED)))
        raise TypeError("a job state is a JobState, a name or a number, not %s"
                        % type(value).__name__)


def _enum_name(enum_type: Any, value: int, prefix: str) -> str:
    """A proto enum value's name, lower case without `prefix`; "unknown_N" for a
    number this client does not know (a newer coordinator's)."""
    try:
        name = str(enum_type.Name(value))
    except ValueError:
        return "unknown_%d" % value
    return name[len(prefix):].lower() if name.startswith(prefix) else name.lower()


def _time(ts: timestamp_pb2.Timestamp) -> Optional[_dt.datetime]:
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    when: _dt.datetime = ts.ToDatetime(tzinfo=_dt.timezone.utc)
    return when


@dataclasses.dataclass(frozen=True)
class Progress:
    """Training progress (``detour.v1.JobProgress``)."""

    iteration: int = 0
    total_iterations: int = 0
    loss: float = 0.0
    tokens_per_s: float = 0.0
    eta_s: float = 0.0
    iteration_time_s: float = 0.0
    predicted_iteration_time_s: float = 0.0
    coordinator_overhead_s: float = 0.0
    utilization: float = 0.0
    utilization_with_kfac: float = 0.0
    kfac_refreshes: int = 0
    kfac_refresh_interval: float = 0.0
    kfac_max_delay_s: float = 0.0
    recoveries: int = 0
    microbatches_rerun: int = 0
    microbatches_dropped: int = 0
    members: int = 0
    # Worker id -> microbatches the last iteration's plan routed through it.
    planned_visits: Mapping[str, int] = dataclasses.field(default_factory=dict, hash=False)

    @classmethod
    def from_proto(cls, p: job_service_pb2.JobProgress) -> "Progress":
        values: Dict[str, Any] = {f.name: getattr(p, f.name) for f in dataclasses.fields(cls)}
        values["planned_visits"] = dict(p.planned_visits)
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class HistoryEvent:
    """Something that happened to a running job (``detour.v1.JobHistoryEvent``).

    ``kind`` is the lower-case kind without its prefix: "worker_lost",
    "rerouted", "worker_joined", "resumed", "replanned", "paused",
    "reattached", "microbatches_dropped", "continued", "checkpoint_skipped",
    "straggler", "reassigned", "configured" (a choice the spec left to the
    coordinator, e.g. the K-FAC replica sync scheme).
    """

    time: Optional[_dt.datetime]
    kind: str
    iteration: int
    worker: str
    message: str

    @classmethod
    def from_proto(cls, e: job_service_pb2.JobHistoryEvent) -> "HistoryEvent":
        return cls(time=_time(e.time),
                   kind=_enum_name(job_service_pb2.JobHistoryEvent.Kind, e.kind, "KIND_"), iteration=e.iteration,
                   worker=e.worker, message=e.message)


@dataclasses.dataclass(frozen=True)
class Job:
    """A job as the coordinator stores it (``detour.v1.Job``).

    ``spec`` is the spec after the coordinator applied its defaults, as a
    ``detour.v1.JobSpec`` message (``spec_dict()`` gives it as a dict in the
    JSON form). ``stages`` lists the node ids of each stage, stage 0 first,
    once assigned. ``owner`` is who submitted it (a token's name or a client
    certificate's CN; "" for an unnamed token or an open coordinator): only
    the owner or an admin may cancel or resume it. ``proto`` is the message
    itself.
    """

    id: str
    name: str
    state: JobState
    message: str
    create_time: Optional[_dt.datetime]
    start_time: Optional[_dt.datetime]
    end_time: Optional[_dt.datetime]
    progress: Progress
    stages: Tuple[Tuple[str, ...], ...]
    last_checkpoint: str
    history: Tuple[HistoryEvent, ...]
    epoch: int
    resumes: int
    owner: str
    spec: spec_pb2.JobSpec = dataclasses.field(repr=False, compare=False)
    proto: job_service_pb2.Job = dataclasses.field(repr=False, compare=False)

    @property
    def ended(self) -> bool:
        return self.state.ended

    @property
    def succeeded(self) -> bool:
        return self.state == JobState.SUCCEEDED

    def spec_dict(self) -> Dict[str, Any]:
        """The spec in the JSON form a spec file uses (field names as in the .proto)."""
        result: Dict[str, Any] = json_format.MessageToDict(self.spec,
                                                           preserving_proto_field_name=True)
        return result

    @classmethod
    def from_proto(cls, j: job_service_pb2.Job) -> "Job":
        state = JobState(j.state) if j.state in JobState._value2member_map_ else \
            JobState.UNSPECIFIED
        return cls(
            id=j.id, name=j.spec.name, state=state, message=j.message,
            create_time=_time(j.create_time), start_time=_time(j.start_time),
            end_time=_time(j.end_time), progress=Progress.from_proto(j.progress),
            stages=tuple(tuple(s.nodes) for s in j.stages), last_checkpoint=j.last_checkpoint,
            history=tuple(HistoryEvent.from_proto(e) for e in j.history), epoch=j.epoch,
            resumes=j.resumes, owner=j.owner, spec=j.spec, proto=j)


@dataclasses.dataclass(frozen=True)
class JobEvent:
    """One update of a watched job (``detour.v1.JobEvent``): the whole job at `time`."""

    time: Optional[_dt.datetime]
    job: Job

    @property
    def state(self) -> JobState:
        return self.job.state

    @property
    def progress(self) -> Progress:
        return self.job.progress

    @classmethod
    def from_proto(cls, e: job_service_pb2.JobEvent) -> "JobEvent":
        return cls(time=_time(e.time), job=Job.from_proto(e.job))


@dataclasses.dataclass(frozen=True)
class Worker:
    """A registered worker (``detour.v1.WorkerInfo``); ``state`` is "idle", "busy" or "lost"."""

    worker_id: str
    state: str
    region: str
    address: str
    device: str
    version: str
    speed: float
    memory_slots: int
    registered_time: Optional[_dt.datetime]
    last_heartbeat_time: Optional[_dt.datetime]
    heartbeats: int
    job_id: str
    session_open: bool
    proto: control_service_pb2.WorkerInfo = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, w: control_service_pb2.WorkerInfo) -> "Worker":
        state = _enum_name(control_service_pb2.WorkerState, w.state, "WORKER_STATE_")
        return cls(worker_id=w.worker_id, state=state, region=w.region, address=w.address,
                   device=w.device, version=w.version, speed=w.speed,
                   memory_slots=w.memory_slots, registered_time=_time(w.registered_time),
                   last_heartbeat_time=_time(w.last_heartbeat_time), heartbeats=w.heartbeats,
                   job_id=w.job_id, session_open=w.session_open, proto=w)
