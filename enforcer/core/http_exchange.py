"""HTTP/1.1 exchanges as plain data, for every port we serve (`edge/http_server.py`): a
request's head, read (RFC 9112); the request; its answer, and the answer's head, written;
and the limits a server keeps.

Whoever reaches a port we serve writes the head, so it is read strictly: a request line of
three parts, header fields of a token, a colon and a value, at most `MAX_FIELDS` of them,
no line folding, one Content-Length, no Transfer-Encoding (nothing we serve takes a chunked
body). Anything else is a `BadHead` with the status to answer and why, never a guess.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from http import HTTPStatus

from enforcer.core.fairness import Bounds
from enforcer.core.parsing import ascii_int

MAX_FIELDS = 100
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/1\.[01]")


class BadHead(Exception):
    """The head cannot be served: `status` to answer, the message says why."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Head:
    method: str
    target: str
    version: str
    headers: Mapping[str, str]  # names in lower case; a repeated field's values joined by ", "

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def keep_alive(self) -> bool:
        """Whether the client will send another request on this connection."""
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens

    @property
    def expects_continue(self) -> bool:
        return self.headers.get("expect", "").lower() == "100-continue"

    def body_length(self) -> int:
        """The body's length in bytes (0 without one). `BadHead` (411) for a chunked body or
        a Content-Length that is not ASCII digits."""
        if "transfer-encoding" in self.headers:
            raise BadHead(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is required, not chunks")
        given = self.headers.get("content-length")
        if given is None:
            return 0
        length = ascii_int(given.strip(), 20)
        if length is None:
            raise BadHead(
                HTTPStatus.LENGTH_REQUIRED, "a Content-Length of ASCII digits is required"
            )
        return length


def head_end(received: bytes) -> tuple[int, int] | None:
    """Where the head ends in what has been received, and the length of its empty line
    (CRLF CRLF, or a bare LF LF); None while it has not ended."""
    crlf, lf = received.find(b"\r\n\r\n"), received.find(b"\n\n")
    if crlf >= 0 and (lf < 0 or crlf < lf):
        return crlf, 4
    return (lf, 2) if lf >= 0 else None


def parse_head(raw: bytes) -> Head:
    """The head (request line and fields, up to its empty line) of one request."""
    lines = [line.removesuffix(b"\r") for line in raw.split(b"\n")]  # CRLF, or a bare LF
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        raise BadHead(HTTPStatus.BAD_REQUEST, "an empty request")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1]:
        raise BadHead(HTTPStatus.BAD_REQUEST, "the request line is not METHOD TARGET VERSION")
    method, target, version = parts
    if not _VERSION.fullmatch(version):
        raise BadHead(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "only HTTP/1.0 and 1.1 are served")
    if len(lines) - 1 > MAX_FIELDS:
        raise BadHead(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"more than {MAX_FIELDS} header fields"
        )
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise BadHead(HTTPStatus.BAD_REQUEST, "a header field is not NAME: VALUE")
        key = name.decode("ascii").lower()
        text = value.strip(b" \t").decode("latin-1")
        if key == "content-length" and key in headers and headers[key] != text:
            raise BadHead(HTTPStatus.BAD_REQUEST, "two different Content-Lengths")
        joined = key in headers and key != "content-length"
        headers[key] = f"{headers[key]}, {text}" if joined else text
    return Head(method.decode("ascii"), target.decode("latin-1"), version.decode("ascii"), headers)


def answer_head(
    status: HTTPStatus, fields: tuple[tuple[str, str], ...], length: int, close: bool
) -> bytes:
    """The status line and fields of an answer of `length` bytes."""
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", *(f"{k}: {v}" for k, v in fields)]
    lines.append(f"Content-Length: {length}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass(frozen=True, slots=True)
class Limits:
    bounds: Bounds
    request_within: float
    answer_within: float
    idle_within: float  # 0: one request per connection
    max_body: int  # a longer body is refused (413) unread
    bodies_in_flight: int  # bytes of bodies held at once; past it, a body waits its turn
    # Bytes of answers not yet taken, at once: past it, the connections whose answers have
    # waited longest are closed.
    answers_in_flight: int


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str
    headers: Mapping[str, str]  # names in lower case
    body: bytes
    peer: str
    started: float  # when its first byte came (monotonic)

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]


@dataclass(frozen=True, slots=True)
class Answer:
    status: HTTPStatus
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    fields: tuple[tuple[str, str], ...] = ()
    close: bool = False  # the connection ends after it (its request's body was not read)


@dataclass(frozen=True, slots=True)
class Later:
    """An answer that costs: made once per pass of the loop, for every request waiting for
    one with the same `key` (None: for its own request alone)."""

    make: Callable[[], Answer]
    key: Hashable | None = None
