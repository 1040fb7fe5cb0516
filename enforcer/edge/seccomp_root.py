"""The allocation gate's profile file under the kubelet's seccomp root
(`<kubelet root>/seccomp/<name>`), where the kubelet resolves a `Localhost` profile.

Written whole or not at all (a temporary file beside it, flushed, then renamed over it):
the runtime reads the file each time it creates a container, and half a profile would stop
that container from starting, or start it without the gate.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def profile_path(kubelet_root: Path, name: str) -> Path:
    return kubelet_root / "seccomp" / name


def write_profile(path: Path, profile: dict[str, Any]) -> str | None:
    """Writes `profile` at `path` (mode 0644, as the runtime reads it); why it could not,
    or None."""
    data = json.dumps(profile, indent=1, sort_keys=True).encode() + b"\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.read_bytes() == data:
            return None  # as it is: nothing to swap under a runtime reading it
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        return f"cannot write the seccomp profile {path}: {exc.strerror or exc}"
    return None
