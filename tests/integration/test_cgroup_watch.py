"""The watch of new pods' and containers' cgroups (`edge/cgroup_watch.py`), with real
inotify: on a real cgroup v2 tree (`cgroup2`) and on a plain directory tree laid out as
the kubelet's cgroupfs driver lays it out. The hard limiter it wakes polls once an hour
here, so what lands before that landed by the watch."""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from enforcer.core.declaration import Declares
from enforcer.core.model import Device, GiB
from enforcer.edge import cgroup_watch
from enforcer.edge.cgroup_watch import CgroupWatch
from enforcer.edge.latest import Latest
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_view import NodeView
from tests.helpers import wait_for
from tests.integration.test_backstop import CID, NEIGHBOUR_ID, declaring
from tests.integration.test_shared_claims_agent import RecordingNvml
from tests.unit.test_shared_claims import uid

RES = "vram-enforcer.io/vram"
HOUR = 3600.0  # the limiter's scan and the watch's own resync: never within a test
LOGGER = "enforcer.edge.cgroup_watch"
GPU = Device(0, "GPU-a", "H100", 80 * GiB, 0)


class Wakes(threading.Event):
    """The hard limiter's wake-up, counting each time it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def set(self) -> None:
        self.count += 1
        super().set()


def systemd_pod(root: Path, pod_uid: str) -> Path:
    """A burstable pod's cgroup as the kubelet's systemd driver makes it."""
    qos = root / "kubepods.slice" / "kubepods-burstable.slice"
    return qos / f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice"


def cgroupfs_pod(root: Path, pod_uid: str) -> Path:
    """A best-effort pod's cgroup as the kubelet's cgroupfs driver makes it."""
    return root / "kubepods" / "besteffort" / f"pod{pod_uid}"


@contextmanager
def running(*threads: HardLimiter | CgroupWatch) -> Iterator[None]:
    """The threads started, and at the end stopped and joined: none is left behind."""
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for t in threads:
            t.stop.set()
            if isinstance(t, HardLimiter):
                t._changed.set()  # its wait for a wake-up ends
        for t in threads:
            t.join(timeout=10)
        assert [t.name for t in threads if t.is_alive()] == []


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def watching(
    root: Path,
    wakes: threading.Event,
    telemetry: AgentTelemetry | None = None,
    *,
    most: int = cgroup_watch.MOST,
    resync: float = HOUR,
) -> CgroupWatch:
    telemetry = telemetry or AgentTelemetry()
    return CgroupWatch(
        root,
        wakes,
        telemetry.cgroup_watch_overflows,
        telemetry.unexpected.labels("cgroup-watch"),
        most=most,
        resync=resync,
    )


@pytest.mark.parametrize("where", ["cgroup v2, systemd driver", "a directory, cgroupfs driver"])
def test_a_pods_and_a_containers_cgroups_get_their_limits_without_waiting_for_the_scan(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The kubelet makes a pod's cgroup, then the runtime a container's below it (the pod's
    status naming it already): the watch wakes the limiter each time, which sets the pod's
    limit, then the container's, with its scan an hour away."""
    systemd = where.startswith("cgroup v2")
    root: Path = request.getfixturevalue("cgroup2") if systemd else tmp_path
    if not systemd:
        (root / "cgroup.controllers").write_text("memory\n")  # what the limiter looks for
    pod_uid = uid("train")
    pods = {pod_uid: declaring(pod_uid, "train", "trainer", CID, {"VRAM_ENFORCER_LIMITS": GiB})}
    pod_dir = (systemd_pod if systemd else cgroupfs_pod)(root, pod_uid)
    pod_dir.parent.mkdir(parents=True)
    container_dir = pod_dir / (f"cri-containerd-{CID}.scope" if systemd else CID)
    nvml, wakes = RecordingNvml(), threading.Event()
    limiter = HardLimiter(
        cast(Nvml, nvml),
        NodeView(lambda: pods, lambda: frozenset({"team"}), Declares(RES)),
        cast(Any, SimpleNamespace(devices=Latest([GPU]), container_usage=Latest({}))),
        cast(Any, None),
        AgentTelemetry(),
        cgroups=(root, HOUR),
        changed=wakes,
    )
    watch = watching(root, wakes)
    with running(limiter, watch):
        wait_for(lambda: watch.watching == 2, what="the watch of kubepods and its QoS class")
        pod_dir.mkdir()
        wait_for(lambda: (str(pod_dir), GPU.uuid) in nvml.set, timeout=60, what="the pod's limit")
        assert (str(container_dir), GPU.uuid) not in nvml.set
        container_dir.mkdir()
        wait_for(
            lambda: (str(container_dir), GPU.uuid) in nvml.set,
            timeout=60,
            what="the container's limit",
        )
    assert nvml.set[str(container_dir), GPU.uuid] == GiB


def test_what_a_tenant_makes_below_its_container_is_not_watched_and_wakes_nothing(
    tmp_path: Path,
) -> None:
    """A container with a cgroup namespace of its own makes directories below its cgroup
    (any number, any depth, named as it likes): none is watched, none wakes the limiter.
    Only the runtime's next container does."""
    pod_dir = cgroupfs_pod(tmp_path, uid("train"))
    pod_dir.mkdir(parents=True)
    wakes = Wakes()
    watch = watching(tmp_path, wakes)
    with running(watch):
        wait_for(lambda: wakes.count == 1, what="the first look")  # kubepods, its QoS, the pod
        assert watch.watching == 3
        tenant = pod_dir / CID
        tenant.mkdir()
        wait_for(lambda: wakes.count == 2, what="the container's wake-up")
        for i in range(50):
            (tenant / f"pod{uid('train')}" / f"kubepods-x-{i}" / NEIGHBOUR_ID).mkdir(parents=True)
        (pod_dir / "not-a-container").mkdir()  # in the pod's: seen, but nobody's cgroup
        (pod_dir / NEIGHBOUR_ID).mkdir()  # the events of a watch come in order
        wait_for(lambda: wakes.count == 3, what="the next container's wake-up")
        assert (wakes.count, watch.watching) == (3, 3)


def test_past_its_bound_the_watch_says_that_the_poll_finds_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At most `most` directories are watched; past that, the log says that the scan finds
    the others' new cgroups (once), and the pods watched still wake the limiter."""
    first, second = (cgroupfs_pod(tmp_path, uid(n)) for n in ("a", "b"))
    first.mkdir(parents=True)
    second.mkdir()
    wakes = Wakes()
    watch = watching(tmp_path, wakes, most=3)
    with caplog.at_level(logging.INFO, LOGGER), running(watch):
        wait_for(lambda: wakes.count == 1, what="the first look")
        assert watch.watching == 3
        cgroupfs_pod(tmp_path, uid("c")).mkdir()  # a new pod: work, but not watched
        wait_for(lambda: wakes.count == 2, what="the new pod's wake-up")
        assert watch.watching == 3
    assert said(caplog) == [
        "new pods' and containers' cgroups are found by the --cgroup-scan poll (each "
        "container's limit lands up to a scan later): more than 3 of the kubelet's "
        "directories to watch"
    ]


def test_an_overflowed_queue_is_counted_said_and_made_whole_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """More events than the kernel queues (fs.inotify.max_queued_events) while the watch
    reads none: the overflow is counted, said, and wakes the limiter (what it lost, the
    limiter's scan finds); the watch looks again at once and says it sees everything."""
    most = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if most > 100_000:
        pytest.skip(f"the kernel queues {most} events: too many directories to make")
    pod_dir = cgroupfs_pod(tmp_path, uid("train"))
    pod_dir.mkdir(parents=True)
    telemetry, wakes = AgentTelemetry(), Wakes()
    watch = watching(tmp_path, wakes, telemetry)
    with caplog.at_level(logging.INFO, LOGGER):
        watch._sync()  # the watches, as its thread makes them first; then it reads nothing
        for i in range(most + 1):
            (pod_dir / f"d{i}").mkdir()
        wakes.clear()
        watch._read()  # what the thread does when it next wakes
        assert telemetry.cgroup_watch_overflows._value.get() == 1
        assert wakes.is_set()
        with running(watch):
            wait_for(lambda: len(said(caplog)) == 2, what="the watch whole again")
            wakes.clear()
            (pod_dir / CID).mkdir()  # and a container still wakes the limiter
            wait_for(wakes.is_set, what="the container's wake-up")
    assert said(caplog) == [
        "new pods' and containers' cgroups are found by the --cgroup-scan poll (each "
        "container's limit lands up to a scan later): the inotify queue overflowed "
        "(fs.inotify.max_queued_events)",
        "new pods' and containers' cgroups wake the hard limiter again (inotify)",
    ]


def test_without_inotify_the_watch_says_so_and_stays_until_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel refuses an inotify instance (fs.inotify.max_user_instances): the log says
    the scan finds new cgroups; the thread neither dies (the agent would exit) nor spins."""

    def refused() -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(cgroup_watch, "Inotify", refused)
    cgroupfs_pod(tmp_path, uid("train")).mkdir(parents=True)
    wakes = Wakes()
    watch = watching(tmp_path, wakes)
    with caplog.at_level(logging.INFO, LOGGER), running(watch):
        wait_for(lambda: said(caplog), what="the log line")
        assert watch.is_alive() and watch.watching == 0 and wakes.count == 0
    assert said(caplog) == [
        "new pods' and containers' cgroups are found by the --cgroup-scan poll (each "
        "container's limit lands up to a scan later): inotify is not available here "
        "(Too many open files)"
    ]


def test_a_hierarchy_that_goes_and_comes_back_is_found_and_watched_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The kubepods directory goes (a kubelet restarted with another cgroup driver, say):
    the log says the scan finds new cgroups; once one is there again, the watch finds it on
    its next look (here every 0.1 s; a minute in the agent) and wakes the limiter again."""
    old = cgroupfs_pod(tmp_path, uid("a"))
    old.mkdir(parents=True)
    wakes = Wakes()
    watch = watching(tmp_path, wakes, resync=0.1)
    with caplog.at_level(logging.INFO, LOGGER), running(watch):
        wait_for(lambda: watch.watching == 3, what="the first look")
        for gone in (old, old.parent, old.parent.parent):
            gone.rmdir()
        wait_for(lambda: watch.watching == 0, what="the watches gone with their directories")
        # Its next look finds no kubepods and says so; only then does one come back (made
        # before that look, it would be found at once, and nothing said: not this case).
        wait_for(lambda: len(said(caplog)) == 1, what="the fallback, said")
        new = systemd_pod(tmp_path, uid("b"))
        new.parent.mkdir(parents=True)
        wait_for(lambda: watch.watching == 2, what="the new hierarchy watched")
        before = wakes.count
        new.mkdir()
        wait_for(lambda: wakes.count > before, what="the new pod's wake-up")
    assert said(caplog) == [
        "new pods' and containers' cgroups are found by the --cgroup-scan poll (each "
        f"container's limit lands up to a scan later): no kubepods directory is below "
        f"{tmp_path} yet",
        "new pods' and containers' cgroups wake the hard limiter again (inotify)",
    ]
