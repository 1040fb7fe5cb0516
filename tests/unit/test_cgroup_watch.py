"""What one read of an inotify descriptor holds, as the kernel lays it out."""

import struct

from enforcer.edge.cgroup_watch import IN_CREATE, IN_ISDIR, IN_Q_OVERFLOW, Event, events


def _event(wd: int, mask: int, name: bytes = b"", padded: int = 0) -> bytes:
    """`struct inotify_event` with its name NUL-padded to `padded` bytes, as the kernel
    pads it (to a multiple of the struct's size)."""
    name = name.ljust(padded, b"\0") if name else b""
    return struct.pack("iIII", wd, mask, 0, len(name)) + name


def test_each_event_of_a_read_is_taken_with_its_name_unpadded() -> None:
    made = "cri-containerd-" + "ab" * 32 + ".scope"
    data = (
        _event(3, IN_CREATE | IN_ISDIR, made.encode(), 96)
        + _event(-1, IN_Q_OVERFLOW)
        + _event(7, IN_CREATE | IN_ISDIR, b"x", 16)
    )
    assert events(data) == [
        Event(3, IN_CREATE | IN_ISDIR, made),
        Event(-1, IN_Q_OVERFLOW, ""),
        Event(7, IN_CREATE | IN_ISDIR, "x"),
    ]


def test_a_name_that_is_not_utf8_is_kept_as_the_filesystem_names_it() -> None:
    (event,) = events(_event(1, IN_CREATE, b"caf\xe9", 16))
    assert event.name.encode("utf-8", "surrogateescape") == b"caf\xe9"


def test_nothing_read_is_no_event() -> None:
    assert events(b"") == []
