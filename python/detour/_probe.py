"""What answers at an address a call could not reach, for a hint in the error.

The Python twin of detourctl's port probe (common/net/port_probe.h): one TCP
connection, an HTTP/1.0 request for "/", and the first bytes of the answer
classified: a plain HTTP/1 server (a metrics port), a TLS server (the client
spoke plaintext; gRPC's TLS server closes on the request without a word, so a
second connection then tries a TLS handshake), or an HTTP/2 server without
TLS (the client spoke TLS to an --insecure coordinator).
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Any, Optional, Tuple

__all__ = ["classify", "port_hint", "probe_port"]

HTTP1 = "http1"
TLS = "tls"
HTTP2_PLAIN = "http2-plain"

_REQUEST = b"GET / HTTP/1.0\r\n\r\n"
_READ_AT_MOST = 16


def classify(data: bytes) -> Optional[str]:
    """HTTP1, TLS, HTTP2_PLAIN or None for the first bytes of an answer."""
    if data.startswith(b"HTTP/1."):
        return HTTP1
    # A TLS record: content type alert (21) or handshake (22), version 3.x.
    if len(data) >= 3 and data[0] in (21, 22) and data[1] == 3:
        return TLS
    # An HTTP/2 frame header: 24-bit length, type SETTINGS (4) or GOAWAY (7).
    if len(data) >= 9 and data[3] in (4, 7):
        return HTTP2_PLAIN
    return None


def _split(address: str) -> Optional[Tuple[str, int]]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def probe_port(address: str, timeout: float) -> Optional[str]:
    """Connects to `address` ("host:port") and classifies what answers; None
    when nothing connects, answers or is recognised within `timeout` s."""
    parts = _split(address)
    if parts is None:
        return None
    deadline = time.monotonic() + timeout
    try:
        found = socket.getaddrinfo(parts[0], parts[1], type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, where in found:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        data = b""
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(left)
                s.connect(where)
                s.sendall(_REQUEST)
                while len(data) < _READ_AT_MOST and classify(data) is None:
                    s.settimeout(max(0.001, deadline - time.monotonic()))
                    chunk = s.recv(_READ_AT_MOST - len(data))
                    if not chunk:
                        break
                    data += chunk
        except OSError:  # refused, reset or timed out: what came so far counts
            pass
        answer = classify(data)
        if answer is None and not data:
            # gRPC's TLS server hangs up on a plain request without a word:
            # ask it for a TLS handshake instead.
            answer = _speaks_tls(family, kind, proto, where, deadline - time.monotonic())
        if answer is not None:
            return answer
    return None


def _speaks_tls(family: int, kind: int, proto: int, where: Any, timeout: float) -> Optional[str]:
    """TLS when a TLS handshake with the server gets as far as its answer (a
    finished handshake or a TLS alert: a refused client certificate is one),
    else None. Nothing is verified: the probe only tells protocols apart."""
    if timeout <= 0:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout)
            s.connect(where)
            with context.wrap_socket(s, do_handshake_on_connect=False) as tls:
                tls.do_handshake()
        return TLS
    except ssl.SSLError as e:
        return TLS if "ALERT" in str(e).upper() else None
    except OSError:
        return None


def port_hint(address: str, tls: bool, answer: Optional[str]) -> str:
    """A sentence for an unreachable `address`, given whether the client used
    TLS; "" when the probe recognised nothing."""
    if answer == HTTP1:
        return ("%s answers plain HTTP/1, not gRPC: is it a metrics port? Give the "
                "coordinator's gRPC address (its --listen)" % address)
    if answer == TLS and not tls:
        return "%s speaks TLS: drop insecure=True and give ca=" % address
    if answer == HTTP2_PLAIN and tls:
        return ("%s speaks plaintext HTTP/2 (a coordinator started with --insecure): "
                "use insecure=True, or start it with TLS" % address)
    return ""
