"""Exceptions of the detour client.

Every error the client raises is a :class:`DetourError`. Failed calls carry
the gRPC status code and the coordinator's own message (which names the
offending field, role or job); the subclasses below stand for the codes a
caller usually handles apart. Client-side mistakes (unreadable certificate
files, a malformed token, contradictory settings) are :class:`ConfigError`;
a spec that cannot be turned into a ``detour.v1.JobSpec``, locally or by the
coordinator's validation, is :class:`InvalidSpec`.
"""

from __future__ import annotations

import re
from typing import Optional

import grpc

__all__ = [
    "DetourError",
    "ConfigError",
    "InvalidArgument",
    "InvalidSpec",
    "NotFound",
    "FailedPrecondition",
    "PermissionDenied",
    "Unauthenticated",
    "Unavailable",
    "DeadlineExceeded",
    "from_rpc_error",
]


class DetourError(Exception):
    """Base of every error the client raises.

    Attributes:
        message: what went wrong; for failed calls the coordinator's message.
        code: the gRPC status code of a failed call; None for errors found
            before any call was made.
        method: the client method that failed ("submit", "get", ...), or "".
        hint: for a coordinator that could not be reached, what answers at
            its address instead when that is recognisable (a metrics port, a
            TLS or a plaintext server), else "".
    """

    def __init__(self, message: str, *, code: Optional[grpc.StatusCode] = None,
                 method: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.method = method
        self.hint = ""

    def __str__(self) -> str:
        parts = []
        if self.method:
            parts.append(self.method)
        if self.code is not None:
            parts.append(self.code.name)
        parts.append(self.message)
        text = ": ".join(parts)
        return "%s (hint: %s)" % (text, self.hint) if self.hint else text


class ConfigError(DetourError, ValueError):
    """The client's own settings are unusable (files, token, contradictions)."""


class InvalidArgument(DetourError):
    """INVALID_ARGUMENT: the coordinator refused a request's contents."""


class InvalidSpec(InvalidArgument):
    """A job spec was refused, by the local JSON parsing or by the coordinator.

    Attributes:
        field: the offending field's path, e.g. "pipeline.skip_ratio", when
            the message names one; else None.
    """

    def __init__(self, message: str, *, field: Optional[str] = None,
                 code: Optional[grpc.StatusCode] = None, method: str = "") -> None:
        super().__init__(message, code=code, method=method)
        self.field = field


class NotFound(DetourError):
    """NOT_FOUND: no job with that id."""


class FailedPrecondition(DetourError):
    """FAILED_PRECONDITION: e.g. cancelling a job that has ended."""


class PermissionDenied(DetourError):
    """PERMISSION_DENIED: the credentials' role is below the call's."""


class Unauthenticated(DetourError):
    """UNAUTHENTICATED: no credentials, or a token the coordinator does not know."""


class Unavailable(DetourError):
    """UNAVAILABLE: the coordinator cannot be reached.

    Also what a failed TLS handshake looks like (a server certificate that
    does not verify against the CA, a plaintext server): the message then
    says so.
    """


class DeadlineExceeded(DetourError):
    """DEADLINE_EXCEEDED: no answer within the call's timeout."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}

# A field path as the coordinator's validators write it: "pipeline.skip_ratio",
# "pipeline.assignment[2]".
_FIELD_PATH = re.compile(r"[a-z_][a-z0-9_]*(\[\d+\])?(\.[a-z_][a-z0-9_]*(\[\d+\])?)*")


def spec_field(message: str) -> Optional[str]:
    """The field a coordinator's spec error names: "spec: FIELD: problem"."""
    text = message[len("spec: "):] if message.startswith("spec: ") else message
    head, sep, _ = text.partition(": ")
    if sep and _FIELD_PATH.fullmatch(head):
        return head
    return None


def from_rpc_error(error: grpc.RpcError, method: str, *, spec: bool = False) -> DetourError:
    """The DetourError for a failed call; `spec` marks calls that send a spec."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    if spec and code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidSpec(details, field=spec_field(details), code=code, method=method)
    cls = _BY_CODE.get(code, DetourError)
    return cls(details, code=code, method=method)
