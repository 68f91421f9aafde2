"""Python client of the detour coordinator (docs/PYTHON.md).

    import detour
    with detour.Client("127.0.0.1:7070", ca="certs/ca.crt", token_file="token") as c:
        job_id = c.submit({"name": "tiny", "model": {"preset": "tiny"}, "iterations": 10})
        job = c.wait(job_id)

The protobuf and gRPC modules are generated from proto/ by the CMake build
into detour._proto (detour._proto.detour.v1.job_service_pb2, ...); the
message classes are also reachable as detour.pb.JobSpec and so on.
"""


def _require(module: str, what: str, pip: str, debian: str) -> None:
    """Imports a module the client needs; on failure an ImportError that says
    which one, why, and which package brings it."""
    import importlib
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            "detour: the Python client needs %s (module %s), which cannot be imported: %s. "
            "Install it: pip install %s, or on Debian apt install %s (docs/PYTHON.md)"
            % (what, module, e, pip, debian)) from e


_require("google.protobuf", "the protobuf runtime", "protobuf", "python3-protobuf")
_require("grpc", "gRPC", "grpcio", "python3-grpcio")
try:
    from detour._proto.detour.v1 import spec_pb2 as _spec_pb2  # noqa: F401
except ImportError as _e:
    if not (getattr(_e, "name", None) or "").startswith("detour._proto"):
        # The generated modules are there but do not load (e.g. made by a
        # newer protoc than this protobuf runtime reads).
        raise ImportError(
            "detour: the generated modules (detour._proto) do not load: %s. Rebuild the "
            "detour_python target against this Python's protobuf (docs/PYTHON.md)" % _e) from _e
    raise ImportError(
        "detour: the generated modules (detour._proto) are missing (%s): this is the source "
        "tree's python/detour. Use the package the CMake build makes (build the detour_python "
        "target, then PYTHONPATH=<build>/python) or the installed one (docs/PYTHON.md)"
        % _e) from _e

from detour import pb
from detour.client import DEFAULT_ADDRESS, DEFAULT_RECONNECT_FOR, DEFAULT_TIMEOUT, Client
from detour.errors import (ConfigError, DeadlineExceeded, DetourError, FailedPrecondition,
                           InvalidArgument, InvalidSpec, NotFound, PermissionDenied,
                           Unauthenticated, Unavailable)
from detour.jobs import HistoryEvent, Job, JobEvent, JobState, Progress, Worker
from detour.spec import load_spec

from detour._version import version as __version__

__all__ = [
    "Client", "DEFAULT_ADDRESS", "DEFAULT_TIMEOUT", "DEFAULT_RECONNECT_FOR",
    "DetourError", "ConfigError", "InvalidArgument", "InvalidSpec", "NotFound",
    "FailedPrecondition", "PermissionDenied", "Unauthenticated", "Unavailable",
    "DeadlineExceeded",
    "Job", "JobEvent", "JobState", "Progress", "HistoryEvent", "Worker",
    "load_spec", "pb",
]
