"""`vram-enforcer` with /dev/null's device major standing in for NVIDIA's: the allocation gate
judges calls on NVIDIA's device nodes only, and this machine has none, so the stand-in
(rm_standin.py) issues the driver's requests on /dev/null. Only what the tier probe reads
from /proc/devices is changed; everything else is the real CLI: `gate_exec.py exec ...`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from enforcer import cli
from enforcer.edge import tier_probe

NULL_MAJOR = os.major(os.stat("/dev/null").st_rdev)

if __name__ == "__main__":
    tier_probe.gpu_device_majors = lambda procfs=None: frozenset({NULL_MAJOR})
    sys.exit(cli.main())
