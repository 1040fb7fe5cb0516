"""A request's head as every port we serve reads it (core/http_exchange.py): strictly, with
the status to answer for anything else."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from enforcer.core.http_exchange import BadHead, answer_head, head_end, parse_head


def test_a_head_is_read_with_its_fields_in_lower_case() -> None:
    head = parse_head(
        b"POST /mutate?timeout=5s HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n"
        b"Accept: a\r\naccept: b\r\n"
    )
    assert (head.method, head.path, head.version) == ("POST", "/mutate", "HTTP/1.1")
    assert head.headers["accept"] == "a, b"
    assert head.body_length() == 12
    assert head.keep_alive


def test_bare_line_feeds_end_a_head_too() -> None:
    assert head_end(b"GET / HTTP/1.0\nHost: x\n\nrest") == (22, 2)
    assert head_end(b"GET / HTTP/1.1\r\n\r\n") == (14, 4)
    assert head_end(b"GET / HTTP/1.1\r\nHost:") is None
    assert parse_head(b"GET /healthz HTTP/1.0\nHost: x").headers == {"host": "x"}


def test_who_keeps_a_connection_alive() -> None:
    assert not parse_head(b"GET / HTTP/1.1\r\nConnection: close").keep_alive
    assert not parse_head(b"GET / HTTP/1.0").keep_alive
    assert parse_head(b"GET / HTTP/1.0\r\nConnection: Keep-Alive").keep_alive


@pytest.mark.parametrize(
    ("raw", "status", "fragment"),
    [
        (b"", HTTPStatus.BAD_REQUEST, "empty"),
        (b"GET /\r\n", HTTPStatus.BAD_REQUEST, "METHOD TARGET VERSION"),
        (b"GET  / HTTP/1.1", HTTPStatus.BAD_REQUEST, "METHOD TARGET VERSION"),
        (b"G(T / HTTP/1.1", HTTPStatus.BAD_REQUEST, "METHOD TARGET VERSION"),
        (b"GET / HTTP/2.0", HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "HTTP/1.0 and 1.1"),
        (b"GET / HTTP/1.1\r\nno colon", HTTPStatus.BAD_REQUEST, "NAME: VALUE"),
        (b"GET / HTTP/1.1\r\n folded: x", HTTPStatus.BAD_REQUEST, "NAME: VALUE"),
        (
            b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2",
            HTTPStatus.BAD_REQUEST,
            "two different Content-Lengths",
        ),
        (
            b"GET / HTTP/1.1" + b"\r\nX: y" * 101,
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
            "more than 100",
        ),
    ],
)
def test_a_head_that_is_not_http_1_gets_the_status_to_answer(
    raw: bytes, status: HTTPStatus, fragment: str
) -> None:
    with pytest.raises(BadHead) as refused:
        parse_head(raw)
    assert refused.value.status == status and fragment in str(refused.value)


@pytest.mark.parametrize("length", ["\u00b2", "9" * 21, "-1", "1e3", ""])
def test_a_body_length_is_ascii_digits_and_never_chunks(length: str) -> None:
    with pytest.raises(BadHead) as refused:
        parse_head(f"POST / HTTP/1.1\r\nContent-Length: {length}".encode()).body_length()
    assert refused.value.status == HTTPStatus.LENGTH_REQUIRED
    chunked = parse_head(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked")
    with pytest.raises(BadHead, match="not chunks"):
        chunked.body_length()


def test_an_answers_head_says_its_length_and_whether_the_connection_ends() -> None:
    assert answer_head(HTTPStatus.OK, (("Content-Type", "text/plain"),), 3, True) == (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n"
        b"Connection: close\r\n\r\n"
    )
