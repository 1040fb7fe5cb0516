"""Who the agent answers, on kernels without SO_PEERPIDFD (Linux < 6.5).

SO_PEERCRED's pid is taken at connect time. If the caller exits and its pid is reused
before the agent pins it, the pinned process is someone else, maybe in another pod. The
agent then makes the pinned process prove, through a challenge answered with kernel-stamped
credentials, that it is the caller. These tests force that path on any kernel
(`peer_pidfd=False`) and reuse a pid for real.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.protocol import encode_challenge
from enforcer.edge.agent_link import AgentLink
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.peers import CREDENTIALS_SPACE, Peer, PeerError, Unproven, attest, sender
from enforcer.edge.procfs import INITIAL_PID_NS, ProcFs
from enforcer.edge.usage_server import ServerMetrics, UsageServer
from tests.helpers import reuse_pid, wait_for

HOST = ProcFs()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[UsageServer]:
    """The agent's socket server, identifying callers as it must on a kernel < 6.5."""
    telemetry = AgentTelemetry()
    metrics = ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected)
    s = UsageServer(tmp_path / "agent.sock", HOST, metrics, stale_after=60.0, peer_pidfd=False)
    s.start()
    me = ProcessKey(os.getpid(), HOST.start_time(os.getpid()) or 0)
    gpu = Device(0, "GPU-0", "NVIDIA H100 80GB HBM3", 80 * GiB, GiB)
    usage = ProcessUsage(me, "GPU-0", GiB, ((INITIAL_PID_NS, me.pid),))
    s.publish(Sample(time.time(), (gpu,), (usage,)))
    yield s
    s.close()


def test_an_honest_caller_answers_the_challenge_and_gets_its_usage(
    server: UsageServer, tmp_path: Path
) -> None:
    source = AgentLink(str(tmp_path / "agent.sock"), stale_after=60.0)
    try:
        sample = wait_for(lambda: isinstance(r := source.sample(), Sample) and r, what="a sample")
        assert [p.key.pid for p in sample.processes] == [os.getpid()]
    finally:
        source.close()


def test_a_caller_that_does_not_answer_learns_nothing(server: UsageServer, tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(tmp_path / "agent.sock"))
        s.sendall(b'{"v":1,"op":"usage"}\n')
        replies = s.makefile("rb")
        for _ in range(2):  # the challenge on connecting, and again for the unproven request
            reply = json.loads(replies.readline())
            assert "challenge" in reply and "SO_PEERPIDFD" in reply["error"]
            assert "processes" not in reply
        s.sendall(b'{"v":1,"op":"usage","challenge":"not-it"}\n')
        assert "the answer to the challenge is wrong" in json.loads(replies.readline())["error"]
        assert replies.readline() == b""  # and it is disconnected


def test_the_doctor_answers_the_challenge(server: UsageServer, tmp_path: Path) -> None:
    from enforcer.modes.doctor import check_agent

    check = check_agent(str(tmp_path / "agent.sock"))
    assert check.status == "ok", check


ACCOMPLICE = textwrap.dedent(
    """
    import json, os, socket, sys
    sys.path.insert(0, sys.argv[2])
    from enforcer.core.protocol import encode_request

    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])       # the caller C, whose pid SO_PEERCRED records
    if os.fork() == 0:           # D inherits the connection and stays
        print(os.getpid(), flush=True)
        replies = s.makefile("rb")
        challenge = json.loads(replies.readline())["challenge"]
        s.sendall(encode_request("usage", challenge))
        print(replies.readline().decode().strip(), flush=True)
        os._exit(0)
    os._exit(0)                  # C exits at once: its pid is free for someone else
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ns_last_pid)")
def test_a_reused_pid_is_not_answered_for_the_caller_that_left(tmp_path: Path) -> None:
    """C connects, leaves the connection to its child D and exits; C's pid goes to another
    process before the agent accepts. Without a proof, the agent would answer D about the
    newcomer's namespace."""
    path = tmp_path / "s.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    caller = subprocess.Popen(
        [sys.executable, "-c", ACCOMPLICE, str(path), str(ROOT)], stdout=subprocess.PIPE, text=True
    )
    assert caller.stdout is not None
    accomplice = int(caller.stdout.readline())
    caller.wait()
    newcomer = reuse_pid(caller.pid)
    conn, _ = listener.accept()
    try:
        peer = attest(conn, HOST, peer_pidfd=False)
        assert not isinstance(peer, Peer), (
            "answered about the newcomer, for whoever holds the connection"
        )
        assert isinstance(peer, Unproven) and peer.pid == newcomer.pid
        conn.sendall(encode_challenge(peer.challenge))
        data, ancillary, _, _ = conn.recvmsg(65536, CREDENTIALS_SPACE)
        assert sender(ancillary) == accomplice  # the kernel says who really sent the answer
        with pytest.raises(
            PeerError, match="answered by another process than the one that connected"
        ):
            peer.prove(json.loads(data)["challenge"], {sender(ancillary) or 0})
        peer.close()
    finally:
        conn.close()
        listener.close()
        newcomer.kill()
        newcomer.wait()
        caller.stdout.close()
