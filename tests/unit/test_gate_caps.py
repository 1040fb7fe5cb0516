"""The allocation gate's caps on the listener fds served by threads of their own."""

from enforcer.core.gate_caps import NODE_WIDE, PER_POD, Caps


def test_beyond_its_pods_cap_an_fd_overflows_and_other_pods_are_not_held_back() -> None:
    caps = Caps(per_pod=2, node_wide=5)
    assert not caps.overflows({}, "a")
    assert not caps.overflows({"a": 1}, "a")
    assert caps.overflows({"a": 2}, "a")
    assert not caps.overflows({"a": 2}, "b")


def test_processes_of_no_known_pod_share_one_cap() -> None:
    caps = Caps(per_pod=2, node_wide=5)
    assert caps.overflows({None: 2, "a": 1}, None)
    assert not caps.overflows({None: 2, "a": 1}, "a")


def test_the_node_wide_cap_holds_over_all_pods() -> None:
    caps = Caps(per_pod=2, node_wide=5)
    assert caps.overflows({"a": 2, "b": 2, None: 1}, "c")
    assert not caps.overflows({"a": 2, "b": 2}, "c")


def test_the_defaults_bound_the_agents_threads() -> None:
    """Two threads per fd: a thousand at most, whatever the pods do."""
    assert (Caps().per_pod, Caps().node_wide) == (PER_POD, NODE_WIDE) == (16, 512)
