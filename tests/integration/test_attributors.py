"""The attributors, driven directly over `/proc` fixture trees: which process counts for
which unit, what is never counted, and that a failed read is never remembered.

`tests/fixtures/proc/pod` is a pod's /proc as its sidecar sees it (the sidecar is pid 40,
`self`): pause (1), the trainer's init (7, the oldest process of its container with parent
0) and its worker (12), four `kubectl exec` shells in the trainer container (2-5, parent 0,
younger, lower pids), a helper container's process (50) and one in a container that the
pod's status does not list (60).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import pytest

from enforcer.core.attribution import PodTerms
from enforcer.core.declaration import Portion, of_sidecar
from enforcer.core.dra import DraObjects, DraSettings
from enforcer.core.model import Activity, Device, GiB, MiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.units import POD_UNIT
from enforcer.edge.procfs import ProcFs
from enforcer.modes.exec import TreeAttributor
from enforcer.modes.sidecar import ALONE_FOR, AloneDetector
from enforcer.modes.sidecar_units import ContainerAttributor, DraReads
from tests.helpers import copy_proc_fixture, set_start_time

TRAINER, HELPER, SIDECAR = "7" * 64, "4" * 64, "5" * 64
POD = {
    "metadata": {"name": "trainer-0"},
    "spec": {"containers": [{"name": "trainer"}, {"name": "helper"}]},
    "status": {
        "initContainerStatuses": [
            {"name": "vram-enforcer", "containerID": f"containerd://{SIDECAR}"}
        ],
        "containerStatuses": [
            {"name": "trainer", "containerID": f"containerd://{TRAINER}"},
            {"name": "helper", "containerID": f"containerd://{HELPER}"},
        ],
    },
}
START = {1: 400000, 7: 500000, 12: 500100, 40: 450000, 50: 500050, 60: 500060}


def key(pid: int) -> ProcessKey:
    return ProcessKey(pid, START[pid])


def sample(usage: dict[int, int]) -> Sample:
    return Sample(
        0.0, (), tuple(ProcessUsage(key(pid), "GPU-0", used) for pid, used in usage.items())
    )


class Refreshes:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    return copy_proc_fixture("pod", tmp_path / "proc")


class ApiView:
    """The pod as the pod watcher has it: None until the API first answers."""

    def __init__(self, pod: dict[str, Any] | None) -> None:
        self.pod = pod

    def __call__(self) -> dict[str, Any] | None:
        return self.pod


class Viewed:
    """The pod as the sidecar's view gives it: the API's last answer, each refresh counted."""

    def __init__(self, api: ApiView, refresh: Callable[[], None]) -> None:
        self._api, self.refresh, self.error = api, refresh, None

    @property
    def pod(self) -> dict[str, Any] | None:
        return self._api()


def attributor(
    proc: Path, pod: dict[str, Any] | ApiView | None = POD, **kwargs: Any
) -> ContainerAttributor:
    options: dict[str, Any] = {"want_init": False, **kwargs}
    api = pod if isinstance(pod, ApiView) else ApiView(pod)
    view = Viewed(api, options.pop("refresh", Refreshes()))
    declared = of_sidecar(  # as `vram-enforcer sidecar` reads its settings
        {"trainer": 4 * GiB},
        options.pop("ceilings", {}),
        options.pop("portions", {}),
        options.pop("gpus", {}),
        claims="dra" in options,
    )
    terms = PodTerms(
        declared,
        options.pop("undeclared_allowed", False),
        options.pop("spec_containers", ()),
    )
    if "dra" in options:
        options["dra"] = DraReads(
            options.pop("dra"),
            options.pop("claims", lambda: None),
            options.pop("problem", lambda text: None),
        )
    return ContainerAttributor(ProcFs(proc), cast(Any, view), terms, **options)


def by_name(units: Any) -> dict[str, Any]:
    return {u.name: u for u in units}


def test_processes_count_for_their_container_and_undeclared_ones_get_a_limit_of_0(
    proc: Path,
) -> None:
    units = by_name(attributor(proc).attribute(sample({12: 3 * GiB, 50: GiB})))
    assert [p.key.pid for p in units["trainer"].processes] == [12]
    assert (units["trainer"].used_bytes, units["trainer"].limit_bytes) == (3 * GiB, 4 * GiB)
    assert (units["helper"].used_bytes, units["helper"].limit_bytes) == (GiB, 0)
    assert units["trainer"].processes[0].cmdline == "python -m torch.distributed.run worker"


def test_a_ceiling_is_the_limit_only_while_the_agent_decides_reclaims(proc: Path) -> None:
    """An agent of an earlier release would never ask for borrowed memory back: with it,
    the container is held to its request, whatever its ceiling."""
    lending = [False]
    a = attributor(proc, ceilings={"trainer": 12 * GiB}, lending=lambda: lending[0])
    assert by_name(a.attribute(sample({12: 3 * GiB})))["trainer"].limit_bytes == 4 * GiB
    lending[0] = True
    assert by_name(a.attribute(sample({12: 3 * GiB})))["trainer"].limit_bytes == 12 * GiB
    # How the agent's asks (by container ID) are matched to this pod's containers.
    assert a.container(TRAINER) == "trainer" and a.container("f" * 64) is None


def test_with_dra_a_ceiling_raises_the_containers_claim_on_its_gpu_while_the_agent_lends(
    proc: Path,
) -> None:
    """The trainer's claim gives it 4Gi on GPU-0, and its ceiling is 12Gi: its unit there
    is held to 12Gi while the agent decides reclaims, with 4Gi its request; to 4Gi else."""
    claimed = {
        **POD,
        "spec": {
            "containers": [
                {"name": "trainer", "resources": {"claims": [{"name": "vram"}]}},
                {"name": "helper"},
            ],
            "resourceClaims": [{"name": "vram", "resourceClaimName": "trainer-vram"}],
        },
    }
    result = {
        "request": "vram",
        "driver": "gpu.nvidia.com",
        "pool": "node",
        "device": "gpu-0",
        "consumedCapacity": {"memory": "4Gi"},
    }
    claim = {
        "metadata": {"name": "trainer-vram"},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }
    slice_ = {
        "spec": {
            "driver": "gpu.nvidia.com",
            "pool": {"name": "node", "generation": 1},
            "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-0"}}}],
        }
    }
    objects = DraObjects({"trainer-vram": claim}, (slice_,))
    lending = [False]
    a = attributor(
        proc,
        claimed,
        dra=DraSettings(),
        claims=lambda: objects,
        ceilings={"trainer": 12 * GiB},
        lending=lambda: lending[0],
    )
    unit = by_name(a.attribute(sample({12: 3 * GiB})))["trainer@GPU-0"]
    # Held to its claim while the agent does not lend; still a borrower, as declared ones are.
    assert (unit.limit_bytes, unit.used_bytes) == (4 * GiB, 3 * GiB)
    assert a.requests == {"trainer@GPU-0": 4 * GiB}
    lending[0] = True
    unit = by_name(a.attribute(sample({12: 3 * GiB})))["trainer@GPU-0"]
    assert (unit.limit_bytes, a.requests) == (12 * GiB, {"trainer@GPU-0": 4 * GiB})


def test_a_limit_spread_over_gpus_is_held_per_gpu_and_a_borrower_asked_back_per_gpu(
    proc: Path,
) -> None:
    """KAI's gpu-fraction-num-devices: 2 for the trainer, 4Gi in all: 2Gi on each GPU it
    uses, its units named by GPU, as the sidecar's Events and the agent's reclaims say."""
    lending = [True]
    a = attributor(
        proc, gpus={"trainer": 2}, ceilings={"trainer": 8 * GiB}, lending=lambda: lending[0]
    )
    on_two = replace(
        sample({12: 3 * GiB}),
        processes=(ProcessUsage(key(12), "GPU-0", 3 * GiB), ProcessUsage(key(12), "GPU-1", GiB)),
    )
    units = by_name(a.attribute(on_two))
    assert {n: (u.used_bytes, u.limit_bytes) for n, u in units.items() if "@" in n} == {
        "trainer@GPU-0": (3 * GiB, 4 * GiB),
        "trainer@GPU-1": (GiB, 4 * GiB),
    }
    assert a.requests == {"trainer@GPU-0": 2 * GiB, "trainer@GPU-1": 2 * GiB}
    lending[0] = False  # held to its request: 2Gi on each
    assert by_name(a.attribute(on_two))["trainer@GPU-0"].limit_bytes == 2 * GiB
    assert "trainer" not in units and units["helper"].limit_bytes == 0


def test_a_portion_of_a_gpu_counts_against_the_smallest_gpu_and_not_before_one_is_known(
    proc: Path,
) -> None:
    """KAI's gpu-fraction for the helper: bytes only once NVML shows a whole GPU's memory;
    until then the helper is not checked at all, never held to 0."""
    lending = [False]
    a = attributor(
        proc,
        portions={"helper": Portion(Decimal("0.25"), Decimal("0.5"))},
        lending=lambda: lending[0],
    )
    usage = {12: 3 * GiB, 50: 30 * GiB}
    unknown = by_name(a.attribute(sample(usage)))
    assert "helper" not in unknown and unknown["trainer"].limit_bytes == 4 * GiB
    # As NVML reports them: 81559 and 23034 MiB; KAI counts 81500 and 23000.
    h100 = Device(0, "GPU-0", "H100", 81559 * MiB, 0)
    l4 = Device(1, "GPU-1", "L4", 23034 * MiB, 0)
    on = replace(sample(usage), devices=(h100,))
    assert by_name(a.attribute(on))["helper"].limit_bytes == 20375 * MiB
    assert a.requests == {"helper": 20375 * MiB}  # what it may borrow above, for reclaims
    lending[0] = True
    assert by_name(a.attribute(on))["helper"].limit_bytes == 40750 * MiB
    # A smaller GPU on the node: the share counts against it, wherever the helper runs.
    both = replace(sample(usage), devices=(h100, l4))
    assert by_name(a.attribute(both))["helper"].limit_bytes == 11500 * MiB


def test_with_undeclared_allowed_an_undeclared_container_is_not_checked(proc: Path) -> None:
    units = by_name(attributor(proc, undeclared_allowed=True).attribute(sample({50: GiB})))
    assert set(units) == {"trainer"}


def test_pause_the_sidecar_and_its_own_container_never_count(proc: Path) -> None:
    units = attributor(proc).attribute(sample({1: GiB, 40: GiB, 12: GiB}))
    assert {p.key.pid for u in units for p in u.processes} == {12}


def test_an_unknown_container_is_reported_for_the_pod_never_enforced(proc: Path) -> None:
    refresh = Refreshes()
    units = by_name(attributor(proc, refresh=refresh).attribute(sample({60: 2 * GiB, 12: GiB})))
    pod = units[POD_UNIT]
    assert not pod.enforceable
    assert {p.key.pid for p in pod.processes} == {60, 12}  # the pod's total, everyone in it
    assert pod.limit_bytes == 4 * GiB  # the sum of the declared limits
    assert refresh.count == 1  # the cached pod may be missing a new container: read it again


def test_restart_targets_the_containers_oldest_process_with_parent_0_not_an_exec_shell(
    proc: Path,
) -> None:
    """`kubectl exec` shells (2-5) also have parent 0 and lower pids: the init is the oldest."""
    units = by_name(attributor(proc, want_init=True).attribute(sample({12: 5 * GiB})))
    init = units["trainer"].init_process
    assert init is not None and init.key == key(7)
    assert init.cmdline == "python train.py"
    assert units["helper"].init_process is not None and units["helper"].init_process.key == key(50)


def test_a_container_taken_whole_is_restarted_by_its_init_else_each_gpu_process(
    proc: Path,
) -> None:
    """Restart semantics when one victim at a time is not enough: the init process, even
    when the action is not `restart` (its end ends every process of the container)."""
    a = attributor(proc)  # action terminate: inits are not looked for on every tick
    units = by_name(a.attribute(sample({12: 5 * GiB})))
    whole = a.whole(units["trainer"])
    assert whole.restart and [p.key for p in whole.processes] == [key(7)]
    set_start_time(proc, 3, START[7])  # an exec shell as old as the init: neither is proven
    whole = a.whole(units["trainer"])
    assert not whole.restart and [p.key for p in whole.processes] == [key(12)]


def test_no_init_is_chosen_when_two_candidates_started_in_the_same_tick(proc: Path) -> None:
    set_start_time(proc, 3, START[7])  # which one is the init is no longer proven
    units = by_name(attributor(proc, want_init=True).attribute(sample({12: 5 * GiB})))
    assert units["trainer"].init_process is None


def test_membership_is_proven_again_for_each_signal(proc: Path) -> None:
    a = attributor(proc)
    a.attribute(sample({12: GiB}))
    trainer = a.membership("trainer")
    assert trainer(12) and trainer(7)
    assert not trainer(50) and not trainer(1) and not trainer(40) and not trainer(60)
    assert not a.membership(POD_UNIT)(12)
    shutil.copy(proc / "50" / "cgroup", proc / "12" / "cgroup")  # moved to another container
    assert not trainer(12)


def test_a_failed_cgroup_read_is_not_remembered(proc: Path) -> None:
    """A read that fails once must not leave the process unenforceable for its whole life."""
    cgroup = proc / "12" / "cgroup"
    saved = cgroup.read_bytes()
    cgroup.unlink()  # unreadable this tick
    a = attributor(proc)
    units = by_name(a.attribute(sample({12: 5 * GiB})))
    assert units["trainer"].processes == ()
    cgroup.write_bytes(saved)
    units = by_name(a.attribute(sample({12: 5 * GiB})))
    assert [p.key.pid for p in units["trainer"].processes] == [12]


def our_tree(tmp_path: Path) -> tuple[Path, ProcessKey]:
    """A /proc with our own process (exec's tree is rooted at its own pid) and one child."""
    me = os.getpid()
    proc = tmp_path / "proc"
    for pid, ppid in ((me, 1), (900001, me)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (x) S {ppid} " + " ".join(["0"] * 30))
        set_start_time(proc, pid, 4242)
    return proc, ProcessKey(900001, 4242)


def test_the_command_tree_forgets_a_process_whose_ancestry_could_not_be_read(
    tmp_path: Path,
) -> None:
    """exec's attributor: an unreadable /proc entry is read again next tick, not cached as an
    outsider."""
    proc, child = our_tree(tmp_path)
    stat = proc / "900001" / "stat"
    saved = stat.read_text()
    stat.unlink()
    tree = TreeAttributor(ProcFs(proc), "job", GiB)
    usage = Sample(0.0, (), (ProcessUsage(child, "GPU-0", 2 * GiB),))
    (unit,) = tree.attribute(usage)
    assert unit.processes == ()
    stat.write_text(saved)
    (unit,) = tree.attribute(usage)
    assert [p.key for p in unit.processes] == [child]
    assert tree.membership("job")(900001)


def test_the_command_tree_counts_every_utilisation_read_that_knew_how_busy_it_was_once(
    tmp_path: Path,
) -> None:
    """exec's mean utilisation, over NVML's utilisation reads: a read that could not yet
    tell about the process counts neither as busy nor idle, the very next one that could is
    in the mean (it is in the metrics), and the passes between two reads, which carry the
    same reading, are not summed again (they cost nothing)."""
    proc, child = our_tree(tmp_path)
    tree = TreeAttributor(ProcFs(proc), "job", GiB)

    def busy(activity: Activity | None, read_at: float | None) -> Sample:
        usage = ProcessUsage(child, "GPU-0", GiB, activity=activity)
        return Sample(0.0, (), (usage,), activity_read_at=read_at)

    assert tree.mean_activity() == (None, None)
    tree.attribute(busy(None, 1.0))  # listed since NVML's last utilisation read
    assert (tree.samples, tree.busy_samples) == (1, 0)
    tree.attribute(busy(Activity(80, 30), 1.5))
    tree.attribute(busy(Activity(80, 30), 1.5))  # the same read, on the next pass
    tree.attribute(busy(Activity(40, 10), 2.0))
    tree.attribute(busy(Activity(40, 10), None))  # no read known: nothing to sum
    assert (tree.samples, tree.busy_samples) == (5, 2)
    assert tree.mean_activity() == (60, 20)


def only_the_trainer(proc: Path) -> Path:
    """The pod fixture with the helper's and the unknown container's processes gone."""
    for pid in (50, 60):
        shutil.rmtree(proc / str(pid))
    return proc


def test_before_the_api_answers_the_only_container_is_enforced_by_its_id(proc: Path) -> None:
    a = attributor(only_the_trainer(proc), pod=None, spec_containers=("trainer",))
    units = by_name(a.attribute(sample({12: 5 * GiB})))
    assert [p.key.pid for p in units["trainer"].processes] == [12]
    assert POD_UNIT not in units
    assert a.membership("trainer")(12) and not a.membership("trainer")(40)


def test_before_the_api_answers_two_containers_are_only_reported(proc: Path) -> None:
    a = attributor(only_the_trainer(proc), pod=None, spec_containers=("trainer", "helper"))
    units = by_name(a.attribute(sample({12: 5 * GiB})))
    assert set(units) == {"trainer", POD_UNIT}  # the declared limit, with nobody proven in it
    assert units["trainer"].processes == () and not units[POD_UNIT].enforceable
    assert not a.membership("trainer")(12)


def test_before_the_api_answers_a_second_container_id_makes_it_ambiguous_for_good(
    proc: Path,
) -> None:
    """An ephemeral container, or a restart: which ID is the container is no longer known."""
    api = ApiView(None)
    a = attributor(proc, pod=api, spec_containers=("trainer",))
    assert by_name(a.attribute(sample({12: 5 * GiB})))["trainer"].processes == ()
    only_the_trainer(proc)
    units = by_name(a.attribute(sample({12: 5 * GiB})))
    assert units["trainer"].processes == () and POD_UNIT in units
    # Once the pod's status is read, it decides.
    api.pod = POD
    units = by_name(a.attribute(sample({12: 5 * GiB})))
    assert [p.key.pid for p in units["trainer"].processes] == [12]


def test_the_legacy_sidecar_is_alone_when_the_status_says_the_others_are_done(proc: Path) -> None:
    api = ApiView({**POD, "spec": {**POD["spec"], "restartPolicy": "Never"}})
    alone = AloneDetector(True, "vram-enforcer", ProcFs(proc), api)
    assert not alone.done(0.0)  # trainer and helper: no state reported, so still running
    done = {"terminated": {"exitCode": 0}}
    statuses = [{**cs, "state": done} for cs in POD["status"]["containerStatuses"]]  # type: ignore[index]
    api.pod = {**api.pod, "status": {**POD["status"], "containerStatuses": statuses}}  # type: ignore[dict-item]
    assert not alone.done(0.5)  # checked at most once a second
    assert alone.done(1.0)


def test_without_the_status_it_is_alone_after_a_while_without_other_processes(proc: Path) -> None:
    alone = AloneDetector(True, "vram-enforcer", ProcFs(proc), ApiView(None))
    assert not alone.done(0.0)  # the trainer's processes are there
    for pid in (2, 3, 4, 5, 7, 12, 50, 60):
        shutil.rmtree(proc / str(pid))
    assert not alone.done(1.0)  # alone since now...
    assert not alone.done(ALONE_FOR)
    assert alone.done(1.0 + ALONE_FOR)  # ...and for ALONE_FOR


def test_without_ever_seeing_another_process_it_never_decides_it_is_alone(proc: Path) -> None:
    for pid in (2, 3, 4, 5, 7, 12, 50, 60):
        shutil.rmtree(proc / str(pid))
    alone = AloneDetector(True, "vram-enforcer", ProcFs(proc), ApiView(None))
    assert not any(alone.done(t) for t in (0.0, 100.0, 1000.0))
    assert not AloneDetector(False, "vram-enforcer", ProcFs(proc), ApiView(None)).done(0.0)
