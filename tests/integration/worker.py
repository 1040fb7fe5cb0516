"""A stand-in for a GPU program, started by the tests under `vram-enforcer exec`.

It reports its pid (and its pid in the host's /proc, when given one) in a JSON file, can
spawn a child or an orphan that does the same, can ignore SIGTERM, starts one more process
on SIGUSR1, and exits 0 once the test creates the release file (or at once, with --leave:
a double fork's intermediate).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def limits_at_start() -> tuple[str, list[dict[str, object]]]:
    """This process's cgroup v2 path, and the per-cgroup limits the fake NVML holds as its
    first instruction runs: a hard limit set "before the command runs" is already here."""
    cgroup = next(
        (
            line[3:]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        ),
        "",
    )
    records = Path(os.environ.get("FAKE_NVML_STATE", "/nonexistent") + ".limits.jsonl")
    found = records.read_text().splitlines() if records.exists() else []
    return cgroup, [json.loads(line) for line in found]


STARTED_IN = limits_at_start()


def report(path: Path, role: str, host_proc: str | None) -> None:
    entry = {
        "role": role,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cgroup": STARTED_IN[0],
        "limits": STARTED_IN[1],
    }
    if host_proc:
        entry["host_pid"] = int(os.readlink(f"{host_proc}/self"))
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(entry))
    tmp.rename(path.with_name(f"{path.name}.{role}"))


def escape() -> None:
    """Write this process into the parent of exec's cgroups, out from under the limit."""
    root = next(
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.partition(" - ")[2].startswith("cgroup2 ")
    )
    outside = STARTED_IN[0].rpartition("/vram-enforcer-")[0]
    Path(root, outside.lstrip("/"), "cgroup.procs").write_text(str(os.getpid()))
    (Path(sys.argv[sys.argv.index("--report") + 1]).with_name("worker.json.escaped")).touch()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--role", default="main")
    p.add_argument("--spawn", choices=("child", "orphan"))
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--host-proc")
    p.add_argument("--exit", type=int, default=0)
    p.add_argument(
        "--leave", action="store_true", help="exit (with --exit) at once, not on release"
    )
    p.add_argument(
        "--leave-cgroup",
        action="store_true",
        help="once reported, move itself into the cgroup that holds exec's own (as its user may)",
    )
    args = p.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # On SIGUSR1, start one more process of the tree (`sleep`), and report its pid.
    late = args.report.with_name(args.report.name + ".late")
    signal.signal(
        signal.SIGUSR1,
        lambda *_: late.write_text(str(os.posix_spawn("/bin/sleep", ["sleep", "60"], os.environ))),
    )
    me = [sys.executable, __file__, "--report", str(args.report)]
    if args.host_proc:
        me += ["--host-proc", args.host_proc]
    if args.ignore_term:
        me.append("--ignore-term")
    if args.spawn == "child":
        subprocess.Popen([*me, "--role", "child"])
    elif args.spawn == "orphan":
        # The intermediate shell exits at once, so the orphan is re-parented to the
        # nearest subreaper: vram-enforcer exec.
        orphan = " ".join(f"'{a}'" for a in [*me, "--role", "orphan"])
        subprocess.run(["sh", "-c", f"{orphan} &"], check=True)
    report(args.report, args.role, args.host_proc)
    if args.leave_cgroup:
        escape()
    if args.leave:
        sys.exit(args.exit)
    release = args.report.with_name(args.report.name + ".release")
    while not release.exists():
        time.sleep(0.02)
    sys.exit(args.exit)


if __name__ == "__main__":
    main()
