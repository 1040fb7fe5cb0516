"""`vram-enforcer interference`'s pure core: workload specs, the plan, outcomes, statistics
and the report, and its heatmap."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from enforcer.core.exec_summary import ExecSummary, SummaryEvent
from enforcer.core.interference.outcomes import Outcome, RunResult, Timing, classify, read_section
from enforcer.core.interference.plan import Phase, RunSpec, plan
from enforcer.core.interference.report import to_json, to_markdown, to_text
from enforcer.core.interference.stats import Method, Report, analyse, overlap, spread
from enforcer.core.interference.workloads import (
    BUILTINS,
    Workload,
    builtin_workloads,
    check_workloads,
    parse_builtins,
    parse_gpu,
    parse_workload,
)
from enforcer.core.model import GiB
from enforcer.core.parsing import ConfigError
from enforcer.edge import heatmap
from enforcer.workloads import PROFILES
from tests.helpers import configured

# ---------------------------------------------------------------------------- workloads


def test_a_workload_splits_on_the_first_two_colons_and_its_command_as_a_shell_would() -> None:
    w = parse_workload("trainer:4Gi:python train.py --url http://x:80 --name 'a b'")
    assert w == Workload(
        "trainer", 4 * GiB, ("python", "train.py", "--url", "http://x:80", "--name", "a b")
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("trainer", "--workload: 'trainer' is not NAME:LIMIT:COMMAND; use NAME:LIMIT:COMMAND"),
        ("trainer:4Gi", "is not NAME:LIMIT:COMMAND"),
        ("a b:4Gi:true", "has the name 'a b'; a name is 1 to 32 letters"),
        (":4Gi:true", "has the name ''"),
        ("trainer:4GB:true", "--workload trainer: LIMIT: '4GB' is not a quantity"),
        ("trainer:4GB:true", "did you mean 4Gi"),
        ("trainer:0:true", "--workload trainer: LIMIT: '0' is 0; declare the GPU memory"),
        ("trainer:4Gi:", "has no COMMAND"),
        ("trainer:4Gi:python 'unclosed", "has a COMMAND that cannot be split"),
    ],
)
def test_a_bad_workload_names_the_field_the_value_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_workload(text)
    assert message in str(raised.value)


def test_builtins_are_known_names_each_once() -> None:
    assert parse_builtins("matmul, copy", "--builtin") == ("matmul", "copy")
    with pytest.raises(ConfigError, match="'gemm', which is not built in; use matmul, copy"):
        parse_builtins("matmul,gemm", "--builtin")
    with pytest.raises(ConfigError, match="names a workload twice"):
        parse_builtins("copy,copy", "--builtin")
    with pytest.raises(ConfigError, match="names no workload"):
        parse_builtins(",", "--builtin")


def test_a_builtin_is_run_by_the_same_python_with_its_declared_limit() -> None:
    (w,) = builtin_workloads(["cnn"], "/usr/bin/python3", "cpu", 0.5)
    assert (w.name, w.limit_bytes) == ("cnn", BUILTINS["cnn"].limit_bytes)
    assert (
        " ".join(w.command) == "/usr/bin/python3 -m enforcer.workloads cnn --device cpu --scale 0.5"
    )
    assert "--scale" not in builtin_workloads(["cnn"], "python", "cuda", 1.0)[0].command


def test_the_builtin_limits_leave_room_for_the_cuda_context() -> None:
    """The catalogue (core) and the workloads agree on names, and each declared limit
    holds the workload's tensors plus 1 GiB for PyTorch's CUDA context and libraries."""
    assert set(BUILTINS) == set(PROFILES)
    for name, profile in PROFILES.items():
        assert BUILTINS[name].limit_bytes >= profile.tensor_bytes + GiB, name


def test_there_must_be_two_workloads_with_names_of_their_own() -> None:
    a, b = Workload("a", GiB, ("true",)), Workload("b", GiB, ("true",))
    assert check_workloads([a, b]) == (a, b)
    with pytest.raises(ConfigError, match="gives 1 workload"):
        check_workloads([a])
    with pytest.raises(ConfigError, match="'a' is the name of two workloads"):
        check_workloads([a, a])


def test_gpu_is_an_index_or_a_uuid() -> None:
    assert parse_gpu("1", "--gpu") == "1"
    assert parse_gpu("GPU-8a7c0c1e-aaaa", "--gpu") == "GPU-8a7c0c1e-aaaa"
    with pytest.raises(ConfigError, match="use its index"):
        parse_gpu("first", "--gpu")


def test_settings_mix_builtins_and_workloads() -> None:
    s = configured(["interference", "--workload", "a:1Gi:sleep 1", "--builtin", "matmul"])
    assert [w.name for w in s.workloads] == ["a", "matmul"]
    assert s.builtins == ("matmul",)
    assert (s.repeat, s.warmup, s.timeout, s.max_spread) == (3, 1, 1800.0, 0.1)
    assert s.workloads[1].command[0] == sys.executable
    with pytest.raises(ConfigError, match="--repeat: '0' is not a whole number of at least 1"):
        configured(["interference", "--builtin", "matmul,copy", "--repeat", "0"])


# ---------------------------------------------------------------------------- the plan


def test_the_plan_warms_up_then_interleaves_alone_and_every_pair_with_the_diagonal() -> None:
    rounds = plan(["a", "b", "c"], repeat=2, warmup=1)
    assert [r.index for r in rounds] == list(range(1, len(rounds) + 1))
    assert [(r.phase, r.runs[0].workload) for r in rounds[:3]] == [(Phase.WARMUP, n) for n in "abc"]
    per_repetition = [(Phase.SOLO, ("a",)), (Phase.SOLO, ("b",)), (Phase.SOLO, ("c",))] + [
        (Phase.PAIR, pair)
        for pair in [("a", "a"), ("a", "b"), ("a", "c"), ("b", "b"), ("b", "c"), ("c", "c")]
    ]
    shape = [(r.phase, tuple(s.workload for s in r.runs)) for r in rounds[3:]]
    assert shape == per_repetition * 2
    assert [r.repetition for r in rounds[3:]] == [1] * 9 + [2] * 9
    diagonal = rounds[6]
    assert diagonal.runs == (RunSpec("a", "a", 1), RunSpec("a", "a", 2))
    assert rounds[7].runs == (RunSpec("a", "b"), RunSpec("b", "a"))
    assert diagonal.label == "a next to a, repetition 1"
    assert rounds[0].label == "a alone, warm-up 1"


def test_no_warmup() -> None:
    assert len(plan(["a", "b"], repeat=1, warmup=0)) == 2 + 3


# ---------------------------------------------------------------------------- outcomes


def summary(**fields: object) -> ExecSummary:
    base: dict[str, object] = {
        "command": ("x",),
        "limit_bytes": GiB,
        "action": "terminate",
        "dry_run": False,
        "exit_status": 0,
        "started": True,
        "start_monotonic": 10.0,
        "end_monotonic": 12.0,
        "peak_bytes": 100,
    }
    return ExecSummary(**(base | fields))  # type: ignore[arg-type]


def test_a_clean_exit_is_ok() -> None:
    assert classify(summary(), 0, "") == (Outcome.OK, "")


def test_going_over_the_limit_wins_over_the_exit_status() -> None:
    event = SummaryEvent("VRAMEnforced", 0.5, "... sent SIGTERM to pid 42 ...", 42)
    over = summary(exit_status=143, signal=None, events=(event,))
    assert classify(over, 143, "Terminated") == (
        Outcome.OVER_LIMIT,
        "went over its 1.00 GiB limit; exec stopped it",
    )
    warned = summary(events=(SummaryEvent("VRAMLimitExceeded", 0.5, "over"),))
    assert classify(warned, 0, "")[0] is Outcome.OVER_LIMIT


@pytest.mark.parametrize(
    "line",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 3.2 MiB is free. Process 4242 has 12 GiB in use",
        "RuntimeError: CUDA error: CUDA_ERROR_OUT_OF_MEMORY. Tried to allocate 2.00 GiB",
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory. Tried to allocate 2.00 GiB",
        "python -m enforcer.workloads copy: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB",
    ],
)
def test_an_out_of_memory_crash_is_told_apart_and_its_reason_kept_short(line: str) -> None:
    outcome, detail = classify(summary(exit_status=1), 1, f"Traceback ...\n{line}\n")
    assert outcome is Outcome.OOM
    assert detail.endswith("Tried to allocate 2.00 GiB")  # not the pids and free memory after


def test_an_oom_under_a_hard_limit_says_the_driver_held_it() -> None:
    _, detail = classify(summary(exit_status=1, hard_limit=True), 1, "CUDA out of memory")
    assert detail == "CUDA out of memory (held to its 1.00 GiB limit by the driver)"


def test_execs_own_lines_are_not_the_commands() -> None:
    stderr = (
        "vram-enforcer: warning: no hard limit: ... an allocation past it fails with out of memory\n"
        "ValueError: bad input\n"
    )
    assert classify(summary(exit_status=3), 3, stderr) == (
        Outcome.FAILED,
        "exit status 3: ValueError: bad input",
    )


def test_other_failures() -> None:
    assert classify(summary(exit_status=137, signal="SIGKILL"), 137, "") == (
        Outcome.FAILED,
        "killed by SIGKILL",
    )
    not_run = summary(started=False, exit_status=127, start_monotonic=None, end_monotonic=None)
    assert classify(not_run, 127, "vram-enforcer: error: nope: command not found\n") == (
        Outcome.FAILED,
        "not started: error: nope: command not found",
    )
    assert classify(None, 2, "vram-enforcer: error: NVML is gone\n") == (
        Outcome.FAILED,
        "exec exited with status 2 and no summary: vram-enforcer: error: NVML is gone",
    )
    assert classify(summary(), 143, "", timed_out_after=90) == (
        Outcome.TIMEOUT,
        "still running after --timeout 90s",
    )
    assert classify(summary(), 130, "", interrupted=True)[0] is Outcome.INTERRUPTED


# ---------------------------------------------------------------------------- statistics


def test_spread_is_the_range_over_the_median() -> None:
    assert spread([10.0, 11.0, 12.0]) == pytest.approx(2 / 11)
    assert spread([5.0]) is None
    assert spread([]) is None


def test_overlap_is_the_share_of_a_span_its_neighbour_ran_too() -> None:
    assert overlap((0.0, 1.0), (0.5, 0.75)) == pytest.approx(0.25)
    assert overlap((0.5, 0.75), (0.0, 1.0)) == pytest.approx(1.0)
    assert overlap((0.0, 1.0), (2.0, 3.0)) == 0.0
    assert overlap((0.0, 1.0), None) is None
    assert overlap((1.0, 1.0), (0.0, 2.0)) is None


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ({"start_monotonic": 1.5, "end_monotonic": 9}, ""),
        ({"start_monotonic": 1.0, "end_monotonic": 10.0}, ""),  # the whole run, at most
        (None, 'is not {"start_monotonic": S, "end_monotonic": E}, on CLOCK_MONOTONIC'),
        ([1.5, 9.0], "is not {"),
        ({"start_monotonic": "1.5", "end_monotonic": 9.0}, "is not {"),
        ({"start_monotonic": True, "end_monotonic": 9.0}, "is not {"),
        ({"start_monotonic": 1.5}, "is not {"),
        ({"start_monotonic": 9.0, "end_monotonic": 1.5}, "ends (1.500) before it starts (9.000)"),
        (
            {"start_monotonic": 0.5, "end_monotonic": 9.0},
            "runs from 0.500 to 9.000, outside "
            "the command's own run, 1.000 to 10.000; write time.monotonic() (CLOCK_MONOTONIC)",
        ),
        ({"start_monotonic": 2.0, "end_monotonic": 10.5}, "outside the command's own run"),
    ],
)
def test_a_timed_section_is_taken_only_inside_execs_own_time_of_the_run(
    doc: object, problem: str
) -> None:
    section, said = read_section(doc, 1.0, 10.0)
    assert problem in said if problem else said == ""
    assert section == (None if problem else (doc["start_monotonic"], doc["end_monotonic"]))  # type: ignore[index]


def test_a_section_cannot_be_checked_without_execs_time() -> None:
    section, said = read_section({"start_monotonic": 1.0, "end_monotonic": 2.0}, None, None)
    assert section is None and said == "cannot be checked: exec did not time the run"


def run(
    round: int,
    phase: Phase,
    workload: str,
    neighbour: str | None,
    seconds: float | None,
    *,
    start: float = 0.0,
    copy: int = 1,
    outcome: Outcome = Outcome.OK,
    peak: int | None = None,
    detail: str = "",
    section: tuple[float, float] | None = None,
    section_problem: str = "",
) -> RunResult:
    end = None if seconds is None else start + seconds
    return RunResult(
        round,
        phase,
        1,
        RunSpec(workload, neighbour, copy),
        outcome,
        detail,
        seconds,
        None if seconds is None else start,
        end,
        peak,
        section=section,
        section_problem=section_problem,
    )


WORKLOADS = (Workload("a", GiB, ("a",)), Workload("b", 2 * GiB, ("b",)))


def measured() -> list[RunResult]:
    """a: 10 s alone; 20 s next to itself; 11 s next to b, which ends after 2 s (OOM)."""
    return [
        run(1, Phase.WARMUP, "a", None, 99.0),  # a cold first run: discarded
        run(2, Phase.SOLO, "a", None, 10.0, peak=GiB // 2),
        run(3, Phase.SOLO, "a", None, 10.4),
        run(4, Phase.SOLO, "b", None, 5.0),
        run(5, Phase.SOLO, "b", None, 5.0),
        run(6, Phase.PAIR, "a", "a", 20.0, peak=GiB // 2 + 1),
        run(6, Phase.PAIR, "a", "a", 20.8, copy=2),
        run(7, Phase.PAIR, "a", "a", 19.6),
        run(7, Phase.PAIR, "a", "a", 20.4, copy=2),
        run(8, Phase.PAIR, "a", "b", 11.0),
        run(8, Phase.PAIR, "b", "a", 2.0, outcome=Outcome.OOM, detail="CUDA out of memory"),
        run(9, Phase.PAIR, "a", "b", 11.0),
        run(9, Phase.PAIR, "b", "a", 2.0, outcome=Outcome.OOM, detail="CUDA out of memory"),
        run(10, Phase.PAIR, "b", "b", 6.0),
        run(10, Phase.PAIR, "b", "b", 6.0, copy=2),
        run(11, Phase.PAIR, "b", "b", 5.0),
        run(11, Phase.PAIR, "b", "b", 99.0, copy=2, outcome=Outcome.INTERRUPTED),
    ]


def report(max_spread: float = 0.1, partial: bool = False) -> Report:
    return analyse(WORKLOADS, measured(), Method(2, 1, max_spread, 17, partial))


def test_slowdown_is_the_median_paired_time_over_the_median_time_alone() -> None:
    r = report()
    assert r.cell("a", None).median == pytest.approx(10.2)  # the warm-up's 99 s is left out
    assert r.cell("a", None).slowdown is None
    assert r.cell("a", "a").slowdown == pytest.approx(20.2 / 10.2)  # both copies count
    assert r.cell("a", "a").seconds == (20.0, 20.8, 19.6, 20.4)
    assert r.cell("a", "b").slowdown == pytest.approx(11 / 10.2)
    assert r.cell("a", None).peak_bytes == GiB // 2
    assert r.cell("a", "a").peak_bytes == GiB // 2 + 1


def test_failures_are_counted_and_interrupted_runs_are_not() -> None:
    r = report()
    b_next_to_a = r.cell("b", "a")
    assert b_next_to_a.slowdown is None and b_next_to_a.failures == ((Outcome.OOM, 2),)
    assert b_next_to_a.problems == ((Outcome.OOM, "CUDA out of memory", 2),)
    b_b = r.cell("b", "b")
    assert b_b.runs == 3 and b_b.seconds == (6.0, 6.0, 5.0)


def test_each_run_of_a_pair_has_its_own_overlap() -> None:
    """b crashed after 2 of a's 11 s: a ran mostly alone, and b next to a all along."""
    r = report()
    assert r.cell("a", "b").overlap == pytest.approx(2 / 11)
    assert r.cell("a", "a").overlap == pytest.approx((1 + 20.0 / 20.8) / 2)  # the median
    assert [c.where for c in r.partly_alone] == ["a next to b"]


def test_stability_names_the_widest_cell_and_flags_those_above_the_threshold() -> None:
    r = report(max_spread=0.1)
    widest = r.largest_spread
    assert widest is not None and widest.where == "b next to b"  # (6 - 5) / 6
    assert [c.where for c in r.unstable] == ["b next to b"]
    assert report(max_spread=0.2).unstable == ()


def test_the_text_report() -> None:
    text = to_text(report())
    lines = text.splitlines()
    assert lines[0].startswith("2 workloads: each alone and next to each (itself included)")
    header = next(line for line in lines if line.startswith("workload"))
    assert header.split() == ["workload", "limit", "alone", "next", "to", "a", "next", "to", "b"]
    row_a = next(line for line in lines if line.startswith("a "))
    assert "10.20 s 512.00 MiB" in row_a and "1.98x 512.00 MiB" in row_a
    assert "1.08x ~" in row_a  # next to b: it ran mostly alone
    row_b = next(line for line in lines if line.startswith("b "))
    assert "OOM 2/2" in row_b and "1.20x *" in row_b  # 6 s / 5 s
    assert "The largest is 16.7% (b next to b)." in text
    assert "* 1 cell(s) spread more than 10%: b next to b 16.7%." in text
    assert "--repeat 5" in text and "--builtin-scale 2" in text
    assert "~ a next to b ran alongside it for 18% of its time (median): b ended first " in text
    assert "(it was stopped or crashed: see below)" in text
    assert "  - b OOM (next to a 2/2): CUDA out of memory" in text
    assert "Times are exec's time of the whole command, start-up included." in text
    assert "SM, its mean SM utilisation" not in text  # none was known
    assert "timed its own section" not in text
    assert "PARTIAL" not in text
    assert "PARTIAL: the measurement was interrupted" in to_text(report(partial=True))


def sectioned(*, b_everywhere: bool = True) -> list[RunResult]:
    """a: 3 s of start-up, then 2 s of work alone, 4 s next to b (whose work overlaps a's
    fully, though b's start-up is 1 s shorter); b's work: 6 s alone, 9 s next to a. The
    whole commands: a 5 s alone and 7 s paired, b 7 s and 10 s."""
    return [
        run(1, Phase.SOLO, "a", None, 5.0, start=0.0, section=(3.0, 5.0)),
        run(2, Phase.SOLO, "b", None, 7.0, start=10.0, section=(11.0, 17.0)),
        run(3, Phase.PAIR, "a", "b", 7.0, start=20.0, section=(23.0, 27.0)),
        run(
            3,
            Phase.PAIR,
            "b",
            "a",
            10.0,
            start=20.0,
            section=(21.0, 30.0) if b_everywhere else None,
            section_problem="" if b_everywhere else "is not {...}",
        ),
    ]


def test_a_workload_that_times_its_work_is_measured_by_it_not_by_its_start_up() -> None:
    r = analyse(WORKLOADS, sectioned(), Method(1, 0, 0.1, 5))
    assert r.timing == {"a": Timing.SECTION, "b": Timing.SECTION}
    assert r.cell("a", None).median == 2.0
    assert r.cell("a", "b").slowdown == pytest.approx(2.0)  # 7 / 5 = 1.4 by whole commands
    assert r.cell("b", "a").slowdown == pytest.approx(1.5)
    assert r.cell("a", "b").overlap == pytest.approx(1.0)  # b's work spans a's
    assert r.cell("b", "a").overlap == pytest.approx(4 / 9)
    text = to_text(r)
    assert "Times are the section the workload timed itself (its work, after its start-up)." in text
    doc = to_json(r)
    assert [w["timing"] for w in doc["workloads"]] == ["section", "section"]
    assert doc["runs"][0]["section_seconds"] == 2.0 and doc["runs"][0]["seconds"] == 5.0


def test_sections_in_only_some_runs_mean_whole_commands_and_the_report_says_why() -> None:
    r = analyse(WORKLOADS, sectioned(b_everywhere=False), Method(1, 0, 0.1, 5))
    assert r.timing == {"a": Timing.SECTION, "b": Timing.COMMAND}
    assert r.cell("b", "a").slowdown == pytest.approx(10 / 7)  # the same kind of time, both
    assert r.cell("a", "b").overlap == pytest.approx(1.0)  # against b's whole command
    text = to_text(r)
    assert (
        "Times are the section the workload timed itself (its work, after its start-up) for "
        "a; exec's time of the whole command, start-up included for b."
    ) in text
    assert (
        "b's figures are exec's times of the whole command, start-up included: it timed its "
        "own section in only 1 of its 2 good run(s). In 1 run(s), the "
        "VRAM_ENFORCER_TIMING_FILE file it wrote is not {...}."
    ) in text


def test_utilisation_is_the_median_of_the_good_runs_and_shown_alone() -> None:
    runs = [
        replace(run(1, Phase.SOLO, "a", None, 1.0), sm_percent=90.0, memory_percent=10.0),
        replace(run(2, Phase.SOLO, "a", None, 1.0), sm_percent=94.0, memory_percent=12.0),
        replace(run(3, Phase.SOLO, "a", None, 1.0), sm_percent=99.0, outcome=Outcome.FAILED),
        run(4, Phase.SOLO, "b", None, 1.0),  # no utilisation known
        replace(run(5, Phase.PAIR, "a", "b", 2.0), sm_percent=48.0),
        run(5, Phase.PAIR, "b", "a", 2.0),
    ]
    r = analyse(WORKLOADS, runs, Method(2, 0, 0.5, 7))
    assert (r.cell("a", None).sm_percent, r.cell("a", None).memory_percent) == (92.0, 11.0)
    assert r.cell("a", "b").sm_percent == 48.0 and r.cell("b", None).sm_percent is None
    row_a = next(line for line in to_text(r).splitlines() if line.startswith("a "))
    assert "SM 92%" in row_a and "SM 48%" not in row_a  # the table shows it alone only
    assert "; SM, its mean SM utilisation alone while it had a process" in to_text(r)
    cell = next(c for c in to_json(r)["cells"] if (c["workload"], c["neighbour"]) == ("a", "b"))
    assert cell["sm_percent"] == 48.0


def test_stability_unknown_with_one_repetition() -> None:
    runs = [run(1, Phase.SOLO, "a", None, 1.0), run(2, Phase.SOLO, "b", None, 1.0)]
    r = analyse(WORKLOADS, runs, Method(1, 0, 0.1, 5))
    assert "Stability unknown" in to_text(r)
    assert "use --repeat 3 or more" in to_text(r)
    assert "| - |" in to_markdown(r)  # pairs not run


def test_markdown_and_json() -> None:
    md = to_markdown(report())
    assert "| workload | limit | alone | next to a | next to b |" in md
    assert "1.20x \\*" in md and "1.08x \\~" in md
    assert "| a | 1.00 GiB | `a` |" in md
    doc = json.loads(json.dumps(to_json(report())))
    assert doc["version"] == 1 and doc["partial"] is False and doc["planned_runs"] == 17
    assert [r["phase"] for r in doc["runs"]].count("warmup") == 1
    assert doc["runs"][0]["seconds"] == 99.0
    cell = next(c for c in doc["cells"] if (c["workload"], c["neighbour"]) == ("b", "a"))
    assert cell["outcomes"] == {"oom": 2}
    assert cell["problems"] == [{"outcome": "oom", "detail": "CUDA out of memory", "runs": 2}]
    assert doc["stability"]["metric"] == "(max - min) / median"
    assert doc["stability"]["largest"]["workload"] == "b"


def test_without_matplotlib_the_heatmap_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert heatmap.write_heatmap(report(), tmp_path / "h.png") == (
        "heatmap.png was not written: matplotlib is not installed; pip install matplotlib "
        "(or, in the vram-enforcer checkout this was installed from, pip install '.[report]')"
    )
    assert not (tmp_path / "h.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_the_heatmap_is_a_png(tmp_path: Path) -> None:
    assert heatmap.write_heatmap(report(partial=True), tmp_path / "h.png") is None
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
