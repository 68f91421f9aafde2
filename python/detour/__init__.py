"""Python client of the detour coordinator (docs/PYTHON.md).

    import detour
    with detour.Client("127.0.0.1:7070", ca="certs/ca.crt", token_file="token") as c:
        job_id = c.submit({"name": "tiny", "model": {"preset": "tiny"}, "iterations": 10})
        job = c.wait(job_id)

The protobuf and gRPC modules are generated from proto/ by the CMake build
into detour._proto (detour._proto.detour.v1.job_service_pb2, ...); the
message classes are also reachable as detour.pb.JobSpec and so on.
"""

try:
    from detour._proto.detour.v1 import spec_pb2 as _spec_pb2  # noqa: F401
except ImportError as _e:  # pragma: no cover - only outside a build
    raise ImportError(
        "detour: the generated modules (detour._proto) are missing: this is the source "
        "tree's python/detour. Use the package the CMake build makes (PYTHONPATH="
        "<build>/python) or the installed one (docs/PYTHON.md). (%s)" % _e) from _e

from detour import pb
from detour.client import DEFAULT_ADDRESS, DEFAULT_TIMEOUT, Client
from detour.errors import (ConfigError, DeadlineExceeded, DetourError, FailedPrecondition,
                           InvalidArgument, InvalidSpec, NotFound, PermissionDenied,
                           Unauthenticated, Unavailable)
from detour.jobs import HistoryEvent, Job, JobEvent, JobState, Progress, Worker
from detour.spec import load_spec

from detour._version import version as __version__

__all__ = [
    "Client", "DEFAULT_ADDRESS", "DEFAULT_TIMEOUT",
    "DetourError", "ConfigError", "InvalidArgument", "InvalidSpec", "NotFound",
    "FailedPrecondition", "PermissionDenied", "Unauthenticated", "Unavailable",
    "DeadlineExceeded",
    "Job", "JobEvent", "JobState", "Progress", "HistoryEvent", "Worker",
    "load_spec", "pb",
]
