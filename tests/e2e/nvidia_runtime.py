"""A stand-in for NVIDIA's container runtime (the outermost boundary): containerd runs every
container through it, as a node with `nvidia` as its default runtime does.

NVIDIA's `nvidia-container-runtime` is a wrapper around runc: on `create`, a container
whose environment asks for GPUs (`NVIDIA_VISIBLE_DEVICES` set, and not `void` or `none`)
gets the driver's libraries mounted into its spec, then runc runs it. This one does the
same with the fake NVML: `libnvidia-ml.so.1` where the driver's copy would be, and the
fake GPU's state file (FAKE_NVML_STATE) at the same path as on the host, so that a test
changes what the containerised agent's NVML shows as it does for an agent on the host.
Every other container reaches runc unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.e2e.node import runc as node_runc
from tests.fakenvml import LIBRARY

# Where Debian (the image's base) and NVIDIA's runtime put the driver's libnvidia-ml.
DRIVER_LIBRARY = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"

_WRAPPER = '''#!{python}
"""nvidia-container-runtime, played: see tests/e2e/nvidia_runtime.py."""
import json
import os
import sys

LIBRARY, STATE, RUNC = {library!r}, {state!r}, {runc!r}


def wants_gpus(env):
    visible = [e.split("=", 1)[1] for e in env if e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    return bool(visible) and visible[-1] not in ("", "void", "none")


def add_driver(bundle):
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    process = spec.setdefault("process", {{}})
    env = process.setdefault("env", [])
    if not wants_gpus(env):
        return
    spec.setdefault("mounts", []).extend([
        {{"destination": {driver!r}, "type": "bind", "source": LIBRARY, "options": ["rbind", "ro"]}},
        {{"destination": os.path.dirname(STATE), "type": "bind", "source": os.path.dirname(STATE),
         "options": ["rbind", "rw"]}},
    ])
    env.append("FAKE_NVML_STATE=" + STATE)
    with open(path, "w") as f:
        json.dump(spec, f)


args = sys.argv[1:]
if "create" in args:
    for i, arg in enumerate(args):
        if arg in ("--bundle", "-b") and i + 1 < len(args):
            add_driver(args[i + 1])
        elif arg.startswith("--bundle="):
            add_driver(arg.split("=", 1)[1])
os.execv(RUNC, [RUNC, *args])
'''


def nvidia_runtime(directory: Path, lib_dir: Path, state_file: Path) -> Path:
    """The wrapper, written in `directory`, that containerd's runc runtime is to run
    (`BinaryName`): the fake NVML from `lib_dir`, its state in `state_file`."""
    wrapper = directory / "nvidia-container-runtime"
    runc = node_runc()  # tests/e2e/build-runc.sh's when it is built
    if runc is None:
        raise FileNotFoundError("no runc: apt-get install runc, or run tests/e2e/build-runc.sh")
    wrapper.write_text(
        _WRAPPER.format(
            python=sys.executable,
            library=str(lib_dir / LIBRARY),
            state=str(state_file),
            runc=runc,
            driver=DRIVER_LIBRARY,
        )
    )
    wrapper.chmod(0o755)
    return wrapper
