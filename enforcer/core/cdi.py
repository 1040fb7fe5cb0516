"""What a CDI spec says about GPU memory limits (pure): whether it runs NVIDIA's
`apply-cuda-memory-limits` hook, and for which GPUs.

The NVIDIA container toolkit (1.20.1+, PR #2075) adds that hook to each full GPU's
`containerEdits` of the spec that `nvidia-ctk cdi generate` writes (`/etc/cdi`, or
`/var/run/cdi`): an OCI `createRuntime` hook, args `[nvidia-cdi-hook,
apply-cuda-memory-limits, --driver-root, <root>, --gpu-id, <uuid>]` (`nvidia-ctk hook ...`
where the spec calls nvidia-ctk). At a container's creation it sets the container's own
cgroup, on those GPUs, to the MiB in its `NVIDIA_GPU_MEMORY_REQUEST` / `_LIMIT`. Specs are
YAML or JSON; the hook's name and `--gpu-id` values are found in either without a parser.
"""

from __future__ import annotations

import re

MEMORY_LIMIT_HOOK = "apply-cuda-memory-limits"
SPEC_SUFFIXES = (".yaml", ".yml", ".json")  # what the CDI registry reads from a spec dir

# `--gpu-id GPU-x` as a YAML list (`- --gpu-id\n  - GPU-x`), a JSON array
# (`"--gpu-id", "GPU-x"`), or `--gpu-id=GPU-x`.
_GPU_ID = re.compile(r"--gpu-id(?:=|[\s\"',\-]+)[\"']?([A-Za-z0-9][\w:.-]*)")


def memory_limit_hook_gpus(spec: str) -> tuple[str, ...]:
    """The GPUs for which this spec runs the memory-limit hook; () where it runs none."""
    if MEMORY_LIMIT_HOOK not in spec:
        return ()
    return tuple(dict.fromkeys(_GPU_ID.findall(spec)))
