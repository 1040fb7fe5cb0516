"""The socket runc hands each gated container's listener fd to (issue 45, step 2): one
message, the fd in SCM_RIGHTS and the ContainerProcessState JSON, from root only; a bad
message is dropped with its fds and the next one served. Real unix sockets."""

from __future__ import annotations

import array
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from enforcer.edge.gate_socket import MAX_STATE, GateSocket, Handoff, parse_state, receive
from tests.helpers import wait_for

# What runc 1.3.7 sent on this machine's e2e node (tests/e2e/test_allocation_gate_e2e.py)
STATE = {
    "ociVersion": "1.2.1",
    "fds": ["seccompFd"],
    "pid": 4242,
    "metadata": "vram-enforcer/gpu-v1",
    "state": {
        "ociVersion": "1.2.1",
        "id": "0f" * 32,
        "status": "creating",
        "pid": 4242,
        "bundle": "/run/containerd/bundle",
        "annotations": {"io.kubernetes.cri.sandbox-name": "trainer-0"},
    },
}


class _Errors:
    def __init__(self) -> None:
        self.count = 0.0

    def inc(self, amount: float = 1) -> None:
        self.count += amount


def send(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    """As runc's utils.SendRawFd: one sendmsg, the fds with the first byte."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    sock.sendmsg([payload], rights if fds else [])


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_a_message_of_runc_gives_its_fd_and_what_it_says_of_the_process() -> None:
    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    # Annotations bigger than one read: the state arrives in pieces, the fd with the first.
    big = {**STATE, "state": {**STATE["state"], "annotations": {"a": "x" * 300_000}}}
    sender = threading.Thread(
        target=lambda: (send(theirs, json.dumps(big).encode(), [w]), theirs.close())
    )
    sender.start()
    found = receive(ours)
    sender.join()
    assert isinstance(found, Handoff), found
    assert (found.pid, found.container_id, found.metadata) == (
        4242,
        "0f" * 32,
        "vram-enforcer/gpu-v1",
    )
    assert len(found.annotations["a"]) == 300_000
    os.write(found.fd, b"!")  # the very pipe we sent
    assert os.read(r, 1) == b"!"
    for fd in (found.fd, r, w):
        os.close(fd)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"{", "not JSON"),
        (json.dumps({"pid": 1}).encode(), "no `state`"),
        (json.dumps({**STATE, "pid": 0}).encode(), "`pid` is 0"),
        (json.dumps({**STATE, "fds": []}).encode(), "`fds`"),
        (json.dumps({**STATE, "state": {**STATE["state"], "id": ""}}).encode(), "`id`"),
    ],
)
def test_a_message_that_is_not_runcs_state_says_why(raw: bytes, why: str) -> None:
    found = parse_state(raw, -1)
    assert isinstance(found, str) and why in found, found


@pytest.mark.parametrize(("fds", "size"), [(2, 100), (0, 100), (1, MAX_STATE + 10)])
def test_a_bad_message_is_dropped_with_every_fd_it_brought(fds: int, size: int) -> None:
    before = open_fds()
    ours, theirs = socket.socketpair()
    pipes = [os.pipe() for _ in range(fds)]
    payload = json.dumps({**STATE, "pad": "x" * size}).encode()
    sender = threading.Thread(
        target=lambda: (send(theirs, payload, [p[1] for p in pipes]), theirs.close())
    )
    sender.start()
    found = receive(ours)
    sender.join()
    assert isinstance(found, str), found
    for r, w in pipes:
        os.close(r)
        os.close(w)
    ours.close()
    assert open_fds() == before  # nothing that came is left open


def serve(path: Path) -> tuple[GateSocket, list[Handoff], _Errors]:
    taken: list[Handoff] = []
    errors = _Errors()
    server = GateSocket(path, taken.append, errors)
    server.start()
    return server, taken, errors


def dial(path: Path, payload: bytes, fd: int) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(str(path))
        send(c, payload, [fd])


def test_the_socket_serves_root_and_goes_on_after_a_bad_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "run" / "seccomp.sock"
    path.parent.mkdir()
    socket.socket(socket.AF_UNIX).bind(str(path))  # a stale socket, as after a restart
    server, taken, errors = serve(path)
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        r, w = os.pipe()
        with caplog.at_level(logging.WARNING):
            dial(path, b"not json", w)
            dial(path, json.dumps(STATE).encode(), w)
            wait_for(lambda: taken, what="the good message")
        assert [t.container_id for t in taken] == ["0f" * 32]
        assert "dropped a message from runc: the state is not JSON" in caplog.text
        assert errors.count == 0
        for fd in (r, w, taken[0].fd):
            os.close(fd)
    finally:
        server.stop()


def test_the_socket_takes_no_fd_from_a_process_that_is_not_root(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever hands us an fd chooses which calls we answer: only runc (root) may."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to connect as another uid")
    # Reachable by anyone, so that only the peer check stands in the way (pytest's own
    # directories are root's alone).
    where = Path(tempfile.mkdtemp(prefix="gate-socket-"))
    os.chmod(where, 0o711)  # noqa: S103
    path = where / "seccomp.sock"
    server, taken, _ = serve(path)
    os.chmod(path, 0o666)  # noqa: S103
    try:
        with caplog.at_level(logging.WARNING):
            child = os.fork()
            if child == 0:  # pragma: no cover - the child
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    _, w = os.pipe()
                    dial(path, json.dumps(STATE).encode(), w)
                finally:
                    os._exit(0)
            os.waitpid(child, 0)
            wait_for(lambda: "refused a connection of uid 65534" in caplog.text, what="the refusal")
        assert taken == []
    finally:
        server.stop()
        shutil.rmtree(where)


def test_a_client_that_trickles_its_message_is_dropped_within_the_timeout_with_its_fd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one thread that takes runc's handoffs is held by a message for `READ_TIMEOUT`
    in all, not per read: a client that sends a byte at a time, never ending, is dropped
    then, and the fd it brought is closed."""
    monkeypatch.setattr("enforcer.edge.gate_socket.READ_TIMEOUT", 1.0)
    before = open_fds()
    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    done = threading.Event()

    def trickle() -> None:
        send(theirs, b"{", [w])
        while not done.wait(0.1):
            theirs.send(b" ")

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        found = receive(ours)
    finally:
        done.set()
        sender.join()
    assert found == "the message could not be read: not sent within 1 s", found
    for fd in (r, w):
        os.close(fd)
    ours.close()
    theirs.close()
    assert open_fds() == before  # the fd that came is closed
