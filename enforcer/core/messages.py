"""The sentences people read: stderr lines, log messages and Kubernetes Event messages.

One place for them keeps `exec`, the sidecar and the docs saying the same thing the same
way. Each sentence answers: who, how much of what limit, and what was (or was not) done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from enforcer.core.alloc_gate import View
from enforcer.core.hard_limits import Holding
from enforcer.core.model import (
    Action,
    LimitOutcome,
    LimitResult,
    ProcessTotal,
    SignalResult,
    UnitUsage,
    Unplaced,
    format_bytes,
)
from enforcer.core.parsing import format_duration
from enforcer.core.policy import Enforcement, Notice
from enforcer.core.reasons import Reason
from enforcer.core.reclaim import Reclaim
from enforcer.core.tier_choice import R615, TierName, driver_branch
from enforcer.core.unaccounted import InNoPod, UndeclaredContainer

_SIGNAL_NAME = {Action.TERMINATE: "SIGTERM", Action.KILL: "SIGKILL", Action.RESTART: "SIGTERM"}

COMMAND_CHARS = 120  # of a command line in a message
_MORE = "..."  # what ends a text that was cut
_SHORT_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}

_REFUSED = {
    SignalResult.GONE: "it had already exited",
    SignalResult.IDENTITY_CHANGED: "its pid now belongs to another process (start time changed)",
    SignalResult.NOT_MEMBER: "it could not be proven to belong to {label}",
    SignalResult.PROTECTED: "it is protected (pid 1 or the enforcer itself)",
    SignalResult.DENIED: "the kernel denied the signal (EPERM: missing CAP_KILL?)",
    SignalResult.UNVERIFIED: "it could not be pinned or read, so its identity is not proven",
    SignalResult.IN_PROGRESS: "it is already being terminated",
}


def amounts(per_container: Mapping[str, int]) -> str:
    """`server 4.00 GiB, trainer 16.00 GiB`, by name."""
    return ", ".join(f"{name} {format_bytes(b)}" for name, b in sorted(per_container.items()))


def usage(unit: UnitUsage, label: str) -> str:
    """`the command tree uses 5.10 GiB of its 4.00 GiB VRAM limit (127%)`."""
    used, limit = unit.used_bytes, unit.limit_bytes
    if limit == 0 and unit.device_uuid is not None:
        return f"{label} uses {format_bytes(used)} of VRAM but was allocated none there"
    if limit == 0:
        return f"{label} uses {format_bytes(used)} of VRAM but declares no VRAM limit"
    share = f" ({100 * used / limit:.0f}%)"
    unknown = " plus usage NVML could not report" if unit.has_unknown else ""
    return (
        f"{label} uses {format_bytes(used)}{unknown} of its {format_bytes(limit)} VRAM limit{share}"
    )


def process(victim: ProcessTotal) -> str:
    """`pid 4242 (python train.py), which holds 5.00 GiB`: the command line is the
    process's own to choose, so it is `shown`."""
    cmd = shown(victim.cmdline, COMMAND_CHARS)
    name = f" ({cmd})" if cmd else ""
    return f"pid {victim.key.pid}{name}, which holds {format_bytes(victim.used_bytes)}"


def shown(text: str, most: int) -> str:
    """Text a tenant chose (a command line) as one line of at most `most` characters that
    reads one way and cannot drive a terminal: what Python's repr escapes is escaped (`\\n`,
    `\\x1b`, `\\u202e`), and a backslash; a byte that is not UTF-8 (kept by surrogateescape)
    reads `\\xff`, so an unprintable character from U+0080 to U+00FF reads `\\u0085`. A
    longer text is cut where an escape ends, and ends in `...`."""
    if text.isprintable() and "\\" not in text:  # ordinary text, untouched
        return _cut(text, most)
    return _within([_escaped(ch) for ch in text[: most + 1]], most)


def one_line(text: str, most: int) -> str:
    """A sentence on its way out (a log line, an Event) as one line of at most `most`
    characters. Ours pass as they are, cut if too long: they carry tenant text `shown`.
    One with a control character (a sidecar's report, which its pod can forge; text logged
    raw) is `shown` whole."""
    return _cut(text, most) if text.isprintable() else shown(text, most)


def _escaped(ch: str) -> str:
    if ch.isprintable() and ch != "\\":
        return ch
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # the byte that surrogateescape could not decode
        return f"\\x{code - 0xDC00:02x}"
    if ch in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[ch]
    if code < 0x80:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - len(_MORE)] + _MORE


def _within(pieces: list[str], most: int) -> str:
    """The pieces joined if they fit in `most` characters, else those that fit with `...`."""
    if sum(map(len, pieces)) <= most:
        return "".join(pieces)
    kept, size = [], len(_MORE)
    for piece in pieces:
        size += len(piece)
        if size > most:
            break
        kept.append(piece)
    return "".join(kept) + _MORE


def notice(n: Notice, label: str, action: Action, warn_at: float, dry_run: bool = False) -> str:
    if n.reason is Reason.NEAR_LIMIT:
        return f"{usage(n.unit, label)}, above the {100 * warn_at:g}% warning threshold"
    if action is Action.WARN:
        consequence = "the action is warn, so nothing is signalled"
    elif not n.unit.enforceable:
        consequence = "not enforced: the containers of some processes cannot be proven yet"
    elif dry_run and n.over_for_left > 0:
        left = format_duration(n.over_for_left)
        consequence = f"dry run: it would be enforced ({action}) if it stayed over for {left}"
    elif dry_run:
        what = "made to give back what it lent" if n.reclaim is not None else "enforced"
        consequence = f"dry run: it would be {what} ({action}); nothing is signalled"
    elif n.over_for_left > 0:
        left = format_duration(n.over_for_left)
        consequence = f"it will be enforced ({action}) if it stays over for {left}"
    elif n.reclaim is not None:
        consequence = f"taking back what it lent ({action})"
    else:
        consequence = f"enforcing ({action})"
    if n.reclaim is not None:
        return f"{reclaim(n.reclaim, label)}; {consequence}"
    return f"{usage(n.unit, label)}; {consequence}"


def reclaim(r: Reclaim, label: str) -> str:
    """Why memory lent above a request is taken back: the GPU, the victim's usage, request
    and ceiling there, and whose needs it falls short of."""
    v = r.victim
    needs = []
    if r.owed_to:
        verb = "is still owed of its request" if len(r.owed_to) == 1 else "are still owed"
        needs.append(f"what {', '.join(r.owed_to)} {verb}")
    if r.for_unrequested:
        needs.append("its other users, which declared no request")
    where = "" if label.endswith(f" on GPU {r.gpu}") else f" on GPU {r.gpu}"  # DRA's names it
    return (
        f"{label} holds {format_bytes(v.used)}{where}, {format_bytes(v.borrowed)} above "
        f"its {format_bytes(v.request)} request (ceiling {format_bytes(v.ceiling)}); the GPU "
        f"has {format_bytes(r.free)} free, {format_bytes(r.shortfall)} less than it must keep "
        f"free for {' and '.join(needs)}"
    )


def enforcement(e: Enforcement, label: str, result: SignalResult) -> str:
    signal = _SIGNAL_NAME.get(e.action, str(e.action))
    head = f"{usage(e.unit, label)}; "
    if e.reclaim is not None:  # the why in full: later reports of it replace this Event
        head = f"{reclaim(e.reclaim, label)}; taking back what it lent: "
    if result is SignalResult.SENT:
        tail = ""
        if e.action is not Action.KILL:
            tail = f"; SIGKILL follows in {format_duration(e.grace_period)} if it has not exited"
        if e.action is Action.RESTART:
            return (
                head
                + f"restarting it: sent {signal} to its init process, {process(e.victim)}{tail}"
            )
        return head + f"sent {signal} to {process(e.victim)}{tail}"
    reason = _REFUSED[result].format(label=label)
    return head + f"did not signal {process(e.victim)}: {reason}"


def would_enforce(e: Enforcement, label: str) -> str:
    """A dry run's report of what it would have signalled, and that nothing was: the usage,
    the most the unit held since it went over and its limit (or, for a reclaim, what it
    borrowed and why the GPU needs it back), the victim and its signals."""
    signal = _SIGNAL_NAME.get(e.action, str(e.action))
    target = process(e.victim)
    if e.action is Action.RESTART:
        target = f"its init process, {target}"
    then = ""
    if e.action is not Action.KILL:
        then = f", then SIGKILL after {format_duration(e.grace_period)} had it not exited"
    done = f"{signal} to {target}{then}"
    peak = format_bytes(max(e.peak_bytes, e.unit.used_bytes))
    why, would = f"{usage(e.unit, label)}, {peak} at most since it went over", f"sent {done}"
    if e.reclaim is not None:
        why, would = reclaim(e.reclaim, label), f"taken back what it lent, sending {done}"
    elif e.action is Action.RESTART:
        would = f"restarted it, sending {done}"
    return f"{why}; dry run, so nothing was signalled: would have {would}"


def whole_unit(
    e: Enforcement,
    label: str,
    targets: Sequence[ProcessTotal],
    results: Sequence[SignalResult],
    grace_period: float,
    restart: bool,
) -> str:
    """Why every process of a unit was stopped at once, and what became of each. `restart`:
    the one target is a container's init, whose end restarts the container."""
    why = (
        f"{usage(e.unit, label)}, still over {format_duration(grace_period)} after a victim "
        "was signalled: its processes are being replaced as fast as they are stopped"
    )
    if not targets:
        return f"{why}; no process of it could be found to stop"
    stopped = [
        t
        for t, r in zip(targets, results, strict=True)
        if r in (SignalResult.SENT, SignalResult.IN_PROGRESS)
    ]
    left = len(targets) - len(stopped)
    refused = f" ({left} could not be proven and were left alone)" if left else ""
    if restart:
        if stopped:
            return f"{why}; restarting it: sent SIGKILL to its init process, {process(targets[0])}"
        return f"{why}; could not restart it: its init process {process(targets[0])} is not proven"
    return f"{why}; sent SIGKILL to all {len(stopped)} processes of {label}{refused}"


def escalated(victim: ProcessTotal, grace_period: float) -> str:
    grace = format_duration(grace_period)
    return f"{process(victim)} did not exit {grace} after SIGTERM; sent SIGKILL"


def about(e: Enforcement, label: str) -> str:
    """What a later report on an enforcement starts with: for a reclaim, its why, which
    the report (an Event of the same reason) replaces; nothing for a limit."""
    return "" if e.reclaim is None else f"{reclaim(e.reclaim, label)}; "


def source_down(reason: str) -> str:
    return (
        f"VRAM usage cannot be observed ({reason}); enforcement is paused and nothing is signalled"
    )


def sidecar_silent(after: float, unreachable: str | None = None, halt: str | None = None) -> str:
    """`unreachable`: why the agent could not connect to the sidecar, when it could not;
    `halt`: how it halted ("stopped", "ended", "refused"), when the agent saw it halt."""
    if halt == "stopped":
        what = (
            "the vram-enforcer sidecar of this pod is stopped (SIGSTOP, or a tracer holds it; "
            "a process of the pod can signal it)"
        )
    elif halt == "ended":
        what = (
            "the vram-enforcer sidecar of this pod ended or hung up its connection to the node "
            "agent (it was killed: a process of the pod can signal it, or it is crash-looping)"
        )
    elif halt == "refused":
        what = (
            "the kernel refuses the signals of this pod's vram-enforcer sidecar (EPERM: a "
            "security module, AppArmor or SELinux, labels the pod's processes apart from it)"
        )
    else:
        why = (
            f"the agent cannot connect to it ({unreachable}): is the sidecar starting, or of "
            "0.1.0 on an agent that does not serve its socket, or does a security profile "
            "(AppArmor) deny the agent ptrace read access to it?"
            if unreachable
            else "it does not read what the agent sends: it may be starved, stuck or crash-looping"
        )
        what = (
            "the vram-enforcer sidecar of this pod has not been connected to the node agent "
            f"for {after:.0f}s: {why}"
        )
    return (
        f"{what}. Until it is back, the node agent enforces the pod's declared "
        "limits (or its claims' allocations, per GPU) itself, with the pod's action; a "
        "container that may borrow keeps its ceiling while the node lends, and gives back "
        "what it borrowed when a neighbour needs it"
    )


def sidecar_back() -> str:
    return "the vram-enforcer sidecar of this pod is connected to the node agent again"


def gpu_unreadable(gpu: str, index: int | None, why: str) -> str:
    at = f" (index {index})" if index is not None else ""
    return (
        f"GPU {gpu}{at} cannot be read ({why}): its processes are not enforced by sampling, "
        "the node's other GPUs are. A GPU that fell off the bus (Xid 79) needs a reset: drain "
        "the node, then reset the GPU (nvidia-smi -r) or reboot"
    )


def gpu_readable(gpu: str) -> str:
    return f"GPU {gpu} can be read again; its processes are enforced again"


def unplaced(pid: int, held: Sequence[Unplaced]) -> str:
    """Said once per listing of a process NVML lists but whose PID namespace cannot be
    read: `held` is what NVML lists for it, a GPU each."""
    on = ", ".join(
        f"{format_bytes(u.used_bytes) if u.used_bytes is not None else 'an unknown amount'} "
        f"on {u.device_uuid}"
        for u in held
    )
    why = held[0].why if held else ""
    return (
        f"pid {pid} holds {on}, but its PID namespace cannot be read ({why}): a security "
        "module (AppArmor, SELinux) refuses the agent, so it cannot be placed in a pod. Its "
        "memory is counted as unplaced (vram_enforcer_gpu_unplaced_bytes), never charged to "
        "a container, and it is never signalled; run the agent under a profile that may "
        "read every process (docs/security.md)"
    )


def undeclared(c: UndeclaredContainer) -> str:
    """Said once on a container of a pod the webhook did not inject that holds GPU memory
    and declares none (or less than it holds), or on the sidecar's container of a pod it
    did, which should hold none."""
    held = " and ".join(f"{format_bytes(used)} of {gpu}" for gpu, used in c.gpus)
    if c.sidecar:
        return (
            f"the vram-enforcer sidecar's container holds {held}; the sidecar uses no GPU "
            "memory, so another process runs in its container (kubectl exec -c "
            f"{c.container.name}, which the chart's webhook.protectInjectedPods refuses to "
            "all but cluster administrators) and declares no VRAM. Nothing limits it; its "
            "memory is counted as undeclared (vram_enforcer_undeclared_used_bytes)"
        )
    what = (
        " and declares no VRAM"
        if c.declared == 0
        else f", more than the {format_bytes(c.declared)} it declares, and no sidecar holds it "
        "to that"
    )
    why = (
        'the webhook did not inject its pod (it opted out with vram-enforcer.io/inject: "false", '
        "or was created before its namespace opted in, or while the webhook was not called)"
        if c.opted_in
        else f"its namespace {c.namespace!r} has not opted in (label vram-enforcer.io/inject="
        "enabled)"
    )
    return (
        f"container {c.container.name!r} holds {held}{what}: {why}. Nothing limits it; its "
        "memory is counted as undeclared (vram_enforcer_undeclared_used_bytes)"
    )


def in_no_pod(pid: int, held: Sequence[InNoPod]) -> str:
    """Said once of a process that stays in no pod of the node: `held`, what it holds on
    each GPU."""
    on = ", ".join(f"{format_bytes(h.usage.used_bytes)} on {h.usage.device_uuid}" for h in held)
    container = held[0].container if held else None
    where = (
        "it runs in no container (a host process)"
        if container is None
        else f"its container {container[:12]} is in no pod's status (started outside the "
        "kubelet: docker run, nerdctl)"
    )
    return (
        f"pid {pid} holds {on} and is in no pod of this node: {where}. Nothing limits it; its "
        "memory is counted as in no pod (vram_enforcer_gpu_outside_pods_bytes)"
    )


def device_look_stuck(pid: int, after: float) -> str:
    return (
        f"pid {pid}: a look at its open files has not come back after "
        f"{format_duration(round(after, 1))}: a file of it is on a filesystem that does not "
        "answer (a hung FUSE daemon, a hard NFS mount whose server is gone). Its GPU usage "
        "stays unknown until the look comes back; the other processes are looked at on "
        "another thread"
    )


def device_looks_wait(stuck: int) -> str:
    return (
        f"{stuck} looks at processes' open files have not come back (hung filesystems): no "
        "other listing of unknown age is proven until one does, and their GPU usage stays "
        "unknown, never free. Find the hung mounts (processes in state D)"
    )


def source_up() -> str:
    return "VRAM usage can be observed again; enforcement resumed"


def no_hard_limit(outcome: LimitOutcome, driver_version: str, cgroup: str) -> str:
    """Why a cgroup got no hard limit, in words a person can act on."""
    detail = f" ({outcome.detail})" if outcome.detail else ""
    branch = driver_branch(driver_version)
    if outcome.result is LimitResult.UNSUPPORTED and branch is not None and branch >= R615:
        # An R615+ driver's Not Supported is the cgroup's: it has no dmem files (NVIDIA).
        where = f"cgroup {cgroup}" if cgroup else "the cgroup"
        return f"{where} has no dmem files{detail}: the driver cannot count it"
    if outcome.result is LimitResult.UNSUPPORTED:
        return (
            f"the NVIDIA driver {driver_version or '(unknown version)'} cannot hold a cgroup to a "
            f"GPU memory limit{detail}; drivers from R615 can"
        )
    if outcome.result is LimitResult.FORBIDDEN:
        return f"NVML refused to set GPU memory limits{detail}: that needs root"
    if outcome.result is LimitResult.NO_CGROUP:
        return f"the NVIDIA driver cannot open the cgroup {cgroup}{detail}"
    if outcome.result is LimitResult.REJECTED:
        return f"NVML rejected the limit for {cgroup}{detail}"
    if outcome.result is LimitResult.NO_DMEM:
        return (
            f"the cgroup {cgroup} has no dmem files, so the driver cannot hold it to a limit"
            f"{detail}; NVIDIA's MPS v3 page: keep `+dmem` in cgroup.subtree_control of every "
            "cgroup from the root down to it"
        )
    if outcome.result is LimitResult.NOT_APPLIED:
        return (
            f"NVML accepted the limit for {cgroup}, but the driver then reads {outcome.detail}: "
            "it does not hold (a read-only cgroup mount, another writer, or a limit below what "
            "the cgroup already holds, which the driver ignores); tried again when the limit "
            "or the cgroup changes"
        )
    return f"setting the GPU memory limit on {cgroup} failed{detail}"


def mig_without_hard_limit(gpus: Sequence[str]) -> str:
    return f"{', '.join(gpus)} in MIG mode, where NVML sets no per-cgroup limits"


def sampling_only(reason: str, interval: float | None = None) -> str:
    """`exec`'s line when it falls back, and the agent's Event for a pod on such a node
    (where the sidecar's interval is not known)."""
    every = f" every {format_duration(interval)}" if interval is not None else ""
    return (
        f"no hard limit: {reason}. The limit is enforced by sampling{every}: an allocation "
        "past it succeeds, and the offender is stopped within one interval"
    )


def hard_limit_in_place(label: str, limits: Mapping[str, int]) -> str:
    """`hard limit in place: the command tree may allocate at most 4.00 GiB on GPU-a, ...`."""
    per_gpu = ", ".join(f"{format_bytes(b)} on {gpu}" for gpu, b in limits.items())
    return (
        f"hard limit in place: {label} may allocate at most {per_gpu}; the driver refuses an "
        "allocation past it (out of memory), and sampling checks the sum over GPUs"
    )


def held_by_driver(limits: Mapping[str, int], owner: str, proof: tuple[str, int, int]) -> str:
    """How the driver holds one container: its limit on each GPU, who set it where it is
    not ours, and the driver's proof that it counts the container's own processes,
    `(gpu, charged, listed)`."""
    per_gpu = ", ".join(f"{format_bytes(b)} on {gpu}" for gpu, b in limits.items())
    by = f" (set by {owner})" if owner else ""
    gpu, charged, listed = proof
    return (
        f"driver-limit, at most {per_gpu}{by}; the driver charges {format_bytes(charged)} on "
        f"{gpu}, where NVML lists {format_bytes(listed)} for its processes"
    )


def pod_tiers(
    pod_limits: Mapping[str, int] | None, pod_why: str, holdings: Sequence[Holding]
) -> str:
    """The pod's one Event: which tier holds each container, led by its pod cgroup's limit
    (or why it has none) where the driver holds some container, else by what sampling
    means."""
    each = "; ".join(f"container {h.container}: {h.how}" for h in holdings)
    if any(h.tier is TierName.DRIVER for h in holdings):
        lead = (
            hard_limit_in_place("the pod", pod_limits)
            if pod_limits is not None
            else f"the pod's cgroup holds no hard limit ({pod_why})"
        )
        return f"{lead}. Per container: {each}"
    return sampling_only(f"{pod_why}; {each}" if pod_why else each)


def not_charged(gpu: str, listed: int, whose: str) -> str:
    """Why a hard limit that the driver accepted does not hold `whose` processes."""
    return (
        f"the driver holds the limit on {gpu} but charges nothing to it, while NVML lists "
        f"{format_bytes(listed)} for {whose} there: the limit does not bind them (the "
        "driver's limits may bind MPS clients only; docs/nvml.md)"
    )


def foreign_limit(whose: str, gpu: str, held: int, owed: int, owner: str) -> str:
    """A limit someone else set on a cgroup we would hold: left as it is, and whether it
    holds `whose` processes to what they are owed there."""
    text = (
        f"{whose} is held by {owner} at {format_bytes(held)} on {gpu}: a limit vram-enforcer "
        "did not set, which it never changes or clears"
    )
    if held <= owed:
        return f"{text}; it is within the {format_bytes(owed)} owed there, so the driver holds it"
    return (
        f"{text}; it is above the {format_bytes(owed)} owed there, so the driver lets it "
        "allocate past its limit, and sampling enforces that limit"
    )


def allocation_unreadable(pid: int, tid: int) -> str:
    """The allocation gate's line for a call it may not read: refused, and how to avoid it."""
    return (
        f"refused a GPU driver call unread (pid {pid} thread {tid}): vram-enforcer cannot read "
        "its process's memory (the process made itself not dumpable, or runs a program its "
        "user may not read, and vram-enforcer lacks CAP_SYS_PTRACE); it failed EPERM. Keep "
        "the command dumpable, run exec as root, or use --allocation-gate off"
    )


def held_by_fractioning() -> str:
    """A pod that gpu-fractioning serves: its limits are its own, set by its hook."""
    return (
        "held by gpu-fractioning (R615 + MPS): its hook sets this pod's limits, and "
        "vram-enforcer sets none; sampling cannot see MPS clients"
    )


def allocation_refused(
    what: str, ask: int, pid: int, tid: int, view: View, now: float, who: str = "the command tree"
) -> str:
    """The allocation gate's one line per refusal: the call, the size, the limit, what `who`
    (exec's command tree, or a container) held and how the gate knew it."""
    ago = (
        "no pass yet" if view.sampled_at is None else f"{(now - view.sampled_at) * 1000:.0f} ms ago"
    )
    return (
        f"refused a GPU allocation of {format_bytes(ask)} ({what}, pid {pid} thread {tid}): "
        f"{who} holds {format_bytes(view.held())} ({format_bytes(view.sampled_bytes)} "
        f"sampled {ago} + {format_bytes(view.since())} let through since) of its "
        f"{format_bytes(view.limit_bytes)} limit; it got the driver's out-of-memory status "
        "(NV_ERR_NO_MEMORY)"
    )
