"""All benchmarks, one command (from the repository root, after `bash .ci/run`):

    .venv/bin/python bench/run.py            # everything, about 25 minutes (the creation storm alone 12)
    .venv/bin/python bench/run.py --quick    # fewer trials and shorter windows
    .venv/bin/python bench/run.py --only agent
    .venv/bin/python bench/run.py --only storm   # 5,000 pods on 500 kwok nodes, twice: 10+ minutes
    .venv/bin/python bench/run.py --only reclaim # borrowing above a request: latency, cost, fit
    .venv/bin/python bench/run.py --only backstop # a stopped sidecar's pod held by the agent
    .venv/bin/python bench/run.py --only pod-memory # what a tenant's large pods cost the agent
    .venv/bin/python bench/run.py --only scrape # the agent's /metrics for a full node, vs per-pod scrapes
    .venv/bin/python bench/run.py --only container-init # a container's init: its cgroup vs /proc
    .venv/bin/python bench/run.py --only cgroup-watch # a new cgroup to its hard limit: inotify vs the scan
    .venv/bin/python bench/run.py --only dial # a sidecar's dial, and the watch with dials hung
    .venv/bin/python bench/run.py --only slow-flood # /healthz and reviews while pods drip into every place
    .venv/bin/python bench/run.py --only allocation-gate # a gated driver call's cost; a flood; overshoot at 10 GiB/s

    # the footprint that ships: the components run from a venv without the dev extras
    python3 -m venv /tmp/rt && /tmp/rt/bin/pip install . && .venv/bin/python bench/run.py --runtime /tmp/rt/bin/python

GPU usage comes from the fake libnvidia-ml.so built from NVIDIA's nvml.h (tests/fakenvml),
so the figures measure the enforcer, not a driver: a real NVML pass costs more per call.
Results are printed and written as JSON to bench/results.json. Method: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import (
    agent_bench,
    api_load_bench,
    backstop_bench,
    cgroup_watch_bench,
    container_init_bench,
    dial_bench,
    exec_bench,
    flood_bench,
    gate_bench,
    hard_limits_bench,
    pod_memory_bench,
    reclaim_bench,
    sampler_bench,
    scrape_bench,
    sidecar_bench,
    slow_flood_bench,
    storm_bench,
    webhook_bench,
)
from bench.common import ROOT
from tests.fakenvml import build_fake_nvml


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer trials and shorter windows")
    p.add_argument(
        "--only",
        choices=(
            "exec",
            "agent",
            "sidecar",
            "webhook",
            "hard-limits",
            "flood",
            "api-load",
            "storm",
            "reclaim",
            "backstop",
            "pod-memory",
            "scrape",
            "container-init",
            "cgroup-watch",
            "dial",
            "slow-flood",
            "allocation-gate",
        ),
        help="run one group",
    )
    p.add_argument(
        "--gate-calls",
        type=int,
        metavar="N",
        help="calls of each kind the allocation gate's cost is measured over "
        "[default: 20000; --quick 5000]",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    p.add_argument(
        "--runtime",
        metavar="PYTHON",
        help="the interpreter that runs the measured components (default: this one); give "
        "one of a venv with only `pip install .` for the memory that ships",
    )
    args = p.parse_args()
    if args.runtime:
        os.environ["VRAM_BENCH_RUNTIME"] = args.runtime
    trials, window, seconds = (40, 3.0, 5.0) if args.quick else (200, 10.0, 30.0)
    lib_dir = build_fake_nvml(ROOT / ".build" / "fakenvml")
    results: dict[str, Any] = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "runtime": args.runtime or sys.executable,
        }
    }
    with tempfile.TemporaryDirectory() as tmp:
        results.update(of_exec(args, trials, window, lib_dir, Path(tmp)))
        if args.only in (None, "reclaim"):
            results["reclaim"] = {
                "latency": reclaim_bench.latency(lib_dir, Path(tmp), "100ms", trials // 2),
                "sidecar_latency": reclaim_bench.sidecar_latency(lib_dir, Path(tmp), trials // 4),
                "lending_cost": reclaim_bench.lending_cost(window),
                "fit": reclaim_bench.fit(5000 if args.quick else 20000),
            }
        if args.only in (None, "agent"):
            results["agent"] = [
                agent_bench.round_trips(lib_dir, Path(tmp), 1, seconds),
                agent_bench.round_trips(lib_dir, Path(tmp), 110, seconds),
                agent_bench.round_trips(lib_dir, Path(tmp), 110, seconds, subscribe=True),
            ]
            results["agent_utilization"] = agent_bench.utilisation_cost(lib_dir, Path(tmp), window)
            results["sampler"] = sampler_bench.run(lib_dir, Path(tmp), trials * 10)
        if args.only in (None, "webhook"):
            results["webhook"] = {
                "in_process": webhook_bench.in_process(trials * 10),
                "https": webhook_bench.over_https(window),
            }
        if args.only in (None, "hard-limits"):
            reason = hard_limits_bench.available()
            if reason:
                print(f"hard-limit benchmarks skipped: {reason}")
            else:
                results["hard_limits"] = hard_limits_bench.agent_cpu(lib_dir, window)
        if "latency" in results:
            results["overshoot"] = hard_limits_bench.overshoot(results["latency"])
        if args.only in (None, "sidecar"):
            reason = sidecar_bench.available()
            if reason:
                print(f"sidecar benchmarks skipped: {reason}")
            else:
                results["sidecar"] = sidecar_bench.run(lib_dir, trials, window)
        results.update(of_the_agent(args.only, args.quick, lib_dir, Path(tmp)))
        results.update(on_a_cluster(args.only, args.quick, lib_dir))
        if args.only in (None, "slow-flood"):
            results["slow_flood"] = slow_flood_bench.run(lib_dir, 10.0 if args.quick else 30.0)
        if args.only in (None, "flood"):
            reason = flood_bench.available()
            if reason:
                print(f"fuzz and flood benchmark skipped: {reason}")
            else:
                results["flood"] = flood_bench.run(lib_dir, trials)
    show(results)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def of_exec(
    args: argparse.Namespace, trials: int, window: float, lib_dir: Path, tmp: Path
) -> dict[str, Any]:
    """`exec`'s own figures: detection latency, CPU per tick, and the allocation gate's."""
    results: dict[str, Any] = {}
    if args.only in (None, "exec"):
        results["latency"] = [
            exec_bench.latency(lib_dir, tmp, iv, trials) for iv in ("100ms", "20ms")
        ]
        results["tick_cost"] = [
            exec_bench.tick_cost(lib_dir, tmp, n, window) for n in (10, 100, 1000)
        ]
    if args.only in (None, "allocation-gate"):  # about three minutes (--quick: half)
        results["allocation_gate"] = gate_bench.run(
            lib_dir,
            tmp,
            args.gate_calls or (5000 if args.quick else 20000),
            10 if args.quick else 20,
        )
    return results


def of_the_agent(only: str | None, quick: bool, lib_dir: Path, tmp: Path) -> dict[str, Any]:
    """What the agent's duties cost: holding a silent pod, a tenant's large pods, a scrape."""
    results: dict[str, Any] = {}
    if only in (None, "backstop"):  # 12-17 s a trial
        results["backstop"] = backstop_bench.run(lib_dir, tmp, 3 if quick else 5)
    if only in (None, "pod-memory"):  # 50 pods of 1.3 MiB (--quick: 20)
        results["pod_memory"] = pod_memory_bench.run(lib_dir, tmp, 20 if quick else 50)
    if only in (None, "scrape"):
        results["scrape"] = scrape_bench.run(110, 5 if quick else 20)
        results["scrape"]["served"] = scrape_bench.served(110, 10 if quick else 40)
    if only in (None, "container-init"):  # 2,000 and 20,000 sleepers: about a minute
        results["container_init"] = container_init_bench.available() or [
            container_init_bench.run(extra, 110, 5 if quick else 20)
            for extra in ((2000,) if quick else (2000, 20000))
        ]
    if only in (None, "cgroup-watch"):  # about 2 s a trial, 40 trials (--quick: 10)
        results["cgroup_watch"] = cgroup_watch_bench.available() or cgroup_watch_bench.run(
            lib_dir, tmp, 10 if quick else 40
        )
    if only in (None, "dial"):  # 15 s a watch, twice (--quick: 5 s)
        results["dial"] = dial_bench.available() or dial_bench.run(
            50 if quick else 200, 20, 5.0 if quick else 15.0
        )
    return results


def on_a_cluster(only: str | None, quick: bool, lib_dir: Path) -> dict[str, Any]:
    """The benchmarks that run the real control plane: API load in steady state, and the
    creation storm."""
    results: dict[str, Any] = {}
    if only in (None, "api-load"):
        reason = api_load_bench.available()
        if reason:
            print(f"API load benchmark skipped: {reason}")
        else:
            results["api_load"] = api_load_bench.run(lib_dir, 20, 60.0 if quick else 180.0)
    if only in (None, "storm"):
        reason = storm_bench.available()
        if reason:
            print(f"creation storm benchmark skipped: {reason}")
        else:
            pods, nodes = (1000, 100) if quick else (5000, 500)
            results["storm"] = [storm_bench.run(dra, pods, nodes, 8) for dra in (False, True)]
    return results


def show_agent(results: dict[str, Any]) -> None:
    if pod_memory := results.get("pod_memory"):
        pod_memory_bench.show(pod_memory)
    if scrape := results.get("scrape"):
        scrape_bench.show(scrape)
    if isinstance(watched := results.get("cgroup_watch"), str):
        print(f"cgroup watch: skipped ({watched})")
    elif watched:
        cgroup_watch_bench.show(watched)
    if isinstance(dialled := results.get("dial"), str):
        print(f"dial: skipped ({dialled})")
    elif dialled:
        dial_bench.show(dialled)
    if isinstance(inits := results.get("container_init"), str):
        print(f"container init: skipped ({inits})")
    elif inits:
        for row in inits:
            container_init_bench.show(row)
    if backstop := results.get("backstop"):
        if isinstance(backstop, str):
            print(f"backstop: skipped ({backstop})")
        else:
            print(
                f"backstop, from a stopped sidecar's pod going over its limit to the SIGTERM: "
                f"p50 {backstop['p50_s']:.2f} s, max {backstop['max_s']:.2f} s over "
                f"{backstop['trials']} trials"
            )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def show(results: dict[str, Any]) -> None:
    """One line per figure, as docs/performance.md quotes them."""
    if row := results.get("slow_flood"):
        slow_flood_bench.show(row)
    if row := results.get("allocation_gate"):
        gate_bench.show(row)
    if row := results.get("flood"):
        peak = row["peak"]
        print(
            f"under fuzz and flood: sidecar detection p50 {row['detection_p50_ms']:.0f} ms, p99 "
            f"{row['detection_p99_ms']:.0f} ms (target <= {row['target_p99_ms']:.0f}), max "
            f"{row['detection_max_ms']:.0f} ms over {row['trials']} trials ({row['missed']} "
            f"missed); a good review p50 "
            f"{row['review_p50_ms']:.1f} ms, p99 {row['review_p99_ms']:.1f} ms; agent /healthz p99 "
            f"{row['healthz_p99_ms']:.1f} ms; {row['hostile_reviews']} hostile reviews, "
            f"{row['hostile_review_5xx']} answered 5xx"
        )
        for name in ("sidecar", "agent", "webhook"):
            print(
                f"  {name}: RSS {row['rss_before_mib'][name]:.1f} MiB before, peak "
                f"{peak[name]['rss_mib']:.1f} MiB and {peak[name]['threads']:.0f} threads "
                "during"
            )
    for row in results.get("latency", ()):
        print(
            f"exec detection latency @ {row['interval_ms']:.0f} ms: p50 {row['p50_ms']:.1f} ms, "
            f"p99 {row['p99_ms']:.1f} ms (target <= {row['target_p99_ms']:.0f} ms), "
            f"max {row['max_ms']:.1f} ms over {row['trials']} trials"
        )
    show_agent(results)
    if reclaim := results.get("reclaim"):
        row = reclaim["latency"]
        print(
            f"reclaim latency, {row['tier']} @ {row['interval_ms']:.0f} ms: p50 "
            f"{row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, max {row['max_ms']:.1f} ms "
            f"over {row['trials']} trials"
        )
        side = reclaim["sidecar_latency"]
        if isinstance(side, str):
            print(f"reclaim latency, sidecar tier: skipped ({side})")
        else:
            print(
                f"reclaim latency, {side['tier']} @ 100 ms: p50 {side['p50_ms']:.1f} ms, p99 "
                f"{side['p99_ms']:.1f} ms, max {side['max_ms']:.1f} ms over {side['trials']} trials"
            )
        cost = reclaim["lending_cost"]
        for label in ("no_ceilings", "half_bursting", "dra_half_bursting"):
            c = cost[label]
            print(
                f"agent's reclaim decision, {cost['pods']} pods on {cost['gpus']} GPUs, "
                f"{label.replace('_', ' ')}: {c['pass_us']:.0f} us per pass "
                f"({c['core_percent_at_10hz']:.2f}% of a core at 100 ms); pods re-read in "
                f"{c['tenants_reread_ms']:.1f} ms"
            )
        fit = reclaim["fit"]
        for r in fit["rows"]:
            print(
                f"tenants of a {fit['peak_gib']:.0f} GiB peak on an 80 GiB GPU, at their peak "
                f"{100 * r['burst_share']:.0f}% of the time: {r['at_peak']} with requests at "
                f"the peak, {r['with_ceilings']} with requests of {fit['request_gib']:.1f} GiB "
                f"and a ceiling at the peak (reclaims in {100 * r['reclaimed_share']:.2f}% of "
                "moments)"
            )
    for row in results.get("tick_cost", ()):
        print(
            f"exec, {row['processes']:>4} processes / 8 GPUs: {row['cpu_ms_per_tick']:.2f} ms CPU per tick "
            f"({row['wall_ms_per_tick']:.2f} ms wall), {100 * row['cpu_share_of_one_core']:.1f}% "
            f"of a core at 100 ms, RSS {row['rss_mib']:.1f} MiB (peak {row['peak_rss_mib']:.1f})"
        )
    for row in results.get("agent", ()):
        what = "round trip" if row["mode"] == "request" else "age of pushed sample"
        print(
            f"agent, {row['callers']:>3} callers ({row['mode']}, 10 Hz): {what} p50 {row['p50_ms']:.2f} ms, "
            f"p99 {row['p99_ms']:.2f} ms, max {row['max_ms']:.1f} ms ({row['requests']} replies, "
            f"{row['requests_per_second']:.0f}/s); agent CPU {100 * row['agent_cpu_share_of_one_core']:.1f}% "
            f"of a core; RSS {row['agent_rss_mib']:.1f} MiB (peak {row['agent_peak_rss_mib']:.1f})"
        )
    if row := results.get("sampler"):
        sampler_bench.show(row)
    if row := results.get("agent_utilization"):
        print(
            f"agent pass, {row['processes']} processes / {row['gpus']} GPUs at {row['interval_ms']} ms, no callers: "
            f"CPU {100 * row['cpu_share_utilization_1s']:.2f}% of a core reading utilisation every 1 s, "
            f"{100 * row['cpu_share_utilization_every_pass']:.2f}% every pass, "
            f"{100 * row['cpu_share_utilization_off']:.2f}% never"
        )
    if row := results.get("hard_limits"):
        print(
            f"agent hard limits, {row['pods']} pods ({row['cgroups']} cgroups x {row['gpus']} GPUs): all set "
            f"{row['all_set_after_s']:.1f} s after start; steady CPU {100 * row['agent_cpu_share_of_one_core']:.2f}% "
            f"of a core (scan every {row['cgroup_scan_s']:.0f} s), against "
            f"{100 * row['agent_cpu_share_without_hard_limits']:.2f}% with --hard-limits off; RSS {row['agent_rss_mib']:.1f} MiB"
        )
        print(
            f"agent hard limits with {row['with_processes']} GPU processes of 1 GiB: every pod's VRAMHardLimit "
            f"(the driver's charge read) {row['all_proven_after_s']:.1f} s after start; steady CPU "
            f"{100 * row['agent_cpu_share_with_processes']:.2f}% of a core, against "
            f"{100 * row['agent_cpu_share_with_processes_without_hard_limits']:.2f}% with --hard-limits off"
        )
    for row in results.get("overshoot", ()):
        print(
            f"overshoot, {row['tier']:>20} at {row['rate_gib_per_s']:>3} GiB/s: p50 {row['p50_gib']:.3f} GiB, "
            f"p99 {row['p99_gib']:.3f} GiB"
        )
    if row := results.get("sidecar"):
        print(
            f"sidecar end-to-end latency (agent 100 ms + sidecar 100 ms): p50 {row['p50_ms']:.1f} ms, "
            f"p99 {row['p99_ms']:.1f} ms (target <= {row['target_p99_ms']} ms), max {row['max_ms']:.1f} ms over "
            f"{row['trials']} trials; CPU {100 * row['cpu_share_of_one_core']:.2f}% of a core; "
            f"RSS {row['rss_mib']:.1f} MiB (peak {row['peak_rss_mib']:.1f}); with --api-access direct: "
            f"p50 {row['direct']['p50_ms']:.1f} ms, RSS {row['direct']['rss_mib']:.1f} MiB "
            f"(peak {row['direct']['peak_rss_mib']:.1f})"
        )
    if row := results.get("api_load"):
        print(
            f"API requests in steady state, {row['pods']} enforced pods on one real node, over "
            f"{row['window_s']:.0f} s (the API server's audit log):"
        )
        for component, found in row["components"].items():
            print(f"  {component}: {found['per_second']:.3f}/s {found['by_request']}")
        fleet = row["at_1000_nodes_of_10_pods"]
        print(
            f"  at 1,000 nodes of 10 pods: sidecars {fleet['sidecars_per_second']:.1f}/s, "
            f"agents {fleet['agents_per_second']:.1f}/s"
        )
        memory = row["sidecar_memory"]
        print(
            f"  sidecar memory in its container's cgroup (the Dockerfile's image, {memory['sidecars']} "
            f"sidecars): anonymous {memory['anon_mib_median']:.1f} MiB median, {memory['anon_mib_max']:.1f} "
            f"max; peak charged {memory['peak_mib_max']:.1f} MiB"
        )
    for row in results.get("storm", ()):
        storm, placed = row["storm"], row["placement"]
        print(
            f"creation storm, {row['mode']} mode: {row['pods']} pods onto {row['nodes']} kwok nodes "
            f"of {row['gpus_per_node']} GPUs from {row['workers']} clients: "
            f"{row['admissions_per_second']:.0f} admissions/s, {sum(storm['failures'].values())} "
            f"failed {storm['failures'] or ''}, {storm['throttled_retries']} 429s retried; webhook "
            f"p50 {_ms(row['webhook_seen_by_apiserver_p50_ms'])}, p99 "
            f"{_ms(row['webhook_seen_by_apiserver_p99_ms'])} as the API server saw it (coarse "
            f"buckets), p50 {_ms(row['webhook_own_p50_ms'])}, p99 {_ms(row['webhook_own_p99_ms'])} "
            f"in the webhook ({row['reviews_per_pod']:.2f} reviews per pod); create p50 "
            f"{placed['server_create_p50_ms']:.0f} ms, p99 {placed['server_create_p99_ms']:.0f} ms; "
            f"every pod bound after {placed['all_bound_after_s']:.1f} s, Running after "
            f"{placed['all_running_after_s']:.1f} s; webhook restarts {row.get('webhook_restarts')}"
        )
    if row := results.get("webhook"):
        local, remote = row["in_process"], row["https"]
        print(
            f"webhook in process: p50 {local['p50_ms']:.2f} ms, p99 {local['p99_ms']:.2f} ms "
            f"(target < {local['target_p99_ms']:.0f} ms) over {local['trials']} reviews of {local['body_bytes']} bytes"
        )
        print(
            f"webhook over HTTPS, one core, {remote['clients']} kept-alive clients: {remote['reviews_per_second']:.0f} "
            f"reviews/s (target > {remote['target_reviews_per_second']}), round trip p50 {remote['p50_ms']:.2f} ms, "
            f"p99 {remote['p99_ms']:.2f} ms; server CPU {100 * remote['server_cpu_share_of_one_core']:.0f}% of its "
            f"core; RSS {remote['rss_mib']:.1f} MiB"
        )


if __name__ == "__main__":
    main()
