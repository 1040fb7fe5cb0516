"""The reason of each Kubernetes Event we post (pure): why a unit, a pod or a node is
reported. The log says the same sentence; `kubectl describe` shows the reason."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a unit is reported; the values are the Kubernetes Event reasons."""

    NEAR_LIMIT = "VRAMNearLimit"
    LIMIT_EXCEEDED = "VRAMLimitExceeded"
    ENFORCED = "VRAMEnforced"
    USAGE_UNKNOWN = "VRAMUsageUnknown"
    HARD_LIMIT = "VRAMHardLimit"  # the agent: the driver holds the pod to its limits
    SAMPLING_ONLY = "VRAMSamplingOnly"  # the agent: no hard limit for the pod, and why
    FOREIGN_LIMIT = "VRAMForeignLimit"  # the agent: a limit it did not set, left as it is
    ALLOCATION_UNKNOWN = "VRAMAllocationUnknown"  # DRA: a container's GPUs are not proven
    GPU_UNREADABLE = "VRAMGpuUnreadable"  # the agent, on its Node: NVML cannot read a GPU
    SIDECAR_SILENT = "VRAMSidecarSilent"  # the agent: a pod's sidecar is gone (or back)
    RECLAIMED = "VRAMReclaimed"  # memory lent above a request is taken back
    EVICTED = "VRAMEvicted"  # the agent: the kernel refused a signal, the pod is evicted
    WOULD_ENFORCE = "VRAMWouldEnforce"  # dry run: what would have been signalled; nothing was
    UNDECLARED = "VRAMUndeclared"  # the agent: a pod it does not enforce holds GPU memory
    ALLOCATION_REFUSED = "VRAMAllocationRefused"  # the allocation gate refused one allocation


# What a sidecar reports, for the agent to post on the sidecar's own pod (`protocol`): its
# pipeline's reasons and what it says of its allocation. The agent's own are not among them,
# so that no process of a pod can post, on its pod, what reads as the agent's word (a hard
# limit in place, a sidecar silent, an eviction).
FROM_SIDECAR = frozenset(
    {
        Reason.NEAR_LIMIT,
        Reason.LIMIT_EXCEEDED,
        Reason.ENFORCED,
        Reason.WOULD_ENFORCE,
        Reason.RECLAIMED,
        Reason.USAGE_UNKNOWN,
        Reason.ALLOCATION_UNKNOWN,
    }
)
