"""The chart through helm's own command line (3.22, tests/e2e/build-helm.sh), as the docs
give it: values with `--set` (a number there is an int64, where helm-sdkpy's and a values
file's are float64), and `helm lint` with the values an install refuses.

Issue 43: `--set agent.reserve=0` failed with "got number, want string" (item 6), and
`helm lint` passed values that `helm install` refuses, since Helm's `fail` only logs under
lint (item 12).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.chart.test_chart_render import REFUSED, _arguments, _program_refusal
from tests.chart.values_schema import CHART_FLAGS
from tests.e2e.helm import CHART, ROOT

# The programs' flags that the chart writes from a value of a form (a quantity, a
# duration): each given as a number, the number that value's form takes if any.
FORMED = [f for f in CHART_FLAGS if f.form is not None]


@pytest.fixture(scope="module")
def helm_cli() -> Path:
    built = subprocess.run(
        ["bash", str(ROOT / "tests" / "e2e" / "build-helm.sh")], capture_output=True, text=True
    )
    if built.returncode != 0:
        reason = f"no helm command line: {built.stderr[-500:]}"
        if os.environ.get("VRAM_ENFORCER_E2E") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    return Path(built.stdout.strip())


def _run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def _template(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`helm template` for a 1.37 cluster (a helm built without its release's flags
    assumes Kubernetes 1.20, which the chart's kubeVersion refuses)."""
    return _run(helm, "template", "vram-enforcer", str(CHART), "--kube-version", "1.37.0", *args)


def _sets(values: dict[str, object]) -> Iterator[str]:
    for path, value in values.items():
        yield from ("--set", f"{path}={value}")


def _number(path: str) -> int:
    return 1 if path == "resource.unit" else 0


def _takes(flag_path: str, text: str) -> bool:
    """Whether every program that the value's flags go to takes `text`."""
    required = {
        "agent": [],
        "webhook": ["--tls-cert-file=/x", "--tls-key-file=/x", "--sidecar-image=x"],
    }
    return all(
        _program_refusal([flag.mode, *required[flag.mode], f"{flag.flag}={text}"]) is None
        for flag in FORMED
        if flag.path == flag_path
    )


def test_a_number_is_taken_where_the_value_s_form_takes_it(helm_cli: Path) -> None:
    """Each value of a quantity or a duration given as a number with `--set` (an int64 to
    the templates) and with `--set-string`: the same arguments, which the programs take;
    where the form takes no number (a duration with a minimum), the install is refused
    naming the value, the form and an example. An image tag of digits is a tag."""
    paths = sorted({f.path for f in FORMED})
    taken = {p: _number(p) for p in paths if _takes(p, str(_number(p)))}
    assert {"agent.reserve", "agent.utilizationInterval", "resource.unit"} <= set(taken)
    bounds = {
        "webhook.tenants.namespaces.research.maxCeiling": 0,
        "webhook.tenants.namespaces.research.maxGracePeriod": 0,
        "image.tag": 20240101,
    }
    rendered = []
    for option in ("--set", "--set-string"):
        out = _template(helm_cli, *[a.replace("--set", option) for a in _sets({**taken, **bounds})])
        assert out.returncode == 0, out.stderr
        rendered.append(out.stdout)
    arguments = _arguments(rendered[0])
    assert arguments == _arguments(rendered[1])
    for args in arguments.values():
        assert _program_refusal(args) is None, args
        assert "--sidecar-image=ghcr.io/vram-enforcer/vram-enforcer:20240101" in args or (
            args[0] == "agent"
        )
    assert '"maxCeiling":"0"' in " ".join(arguments["webhook"])
    for path in sorted(set(paths) - set(taken)):
        out = _template(helm_cli, "--set", f"{path}=0")
        assert out.returncode != 0 and f'{path}: "0" is not ' in out.stderr, out.stderr
        assert "e.g." in out.stderr and len(out.stderr) < 600, out.stderr


def test_a_large_number_in_a_values_file_is_written_whole(helm_cli: Path, tmp_path: Path) -> None:
    """A values file's numbers are float64 to the templates, which print 1073741824 as
    1.073741824e+09: the chart writes its digits."""
    values = tmp_path / "values.yaml"
    values.write_text(
        "agent: {reserve: 1073741824}\nimage: {tag: 20240101}\n"
        "webhook: {tenants: {maxCeiling: 85899345920}, shmDefault: 2000000}\n"
    )
    out = _template(helm_cli, "-f", str(values))
    assert out.returncode == 0, out.stderr
    arguments = _arguments(out.stdout)
    assert "--reserve=1073741824" in arguments["agent"]
    assert "--max-vram-ceiling=85899345920" in arguments["webhook"]
    assert "--shm-default=2000000" in arguments["webhook"]
    assert "image: ghcr.io/vram-enforcer/vram-enforcer:20240101" in out.stdout
    for args in arguments.values():
        assert _program_refusal(args) is None, args


def test_lint_refuses_what_the_install_refuses(helm_cli: Path, tmp_path: Path) -> None:
    """Every refusal of tests/chart/test_chart_render.py (the schema's, and the templates'
    `fail`s, which Helm's lint only logs) fails `helm lint` too, naming the value; the
    defaults lint clean."""
    assert _run(helm_cli, "lint", str(CHART)).returncode == 0
    for i, (values, names) in enumerate(REFUSED):
        given = tmp_path / f"values-{i}.yaml"
        given.write_text(yaml.safe_dump(json.loads(json.dumps(values))))
        out = _run(helm_cli, "lint", str(CHART), "-f", str(given))
        assert out.returncode != 0, (values, out.stdout)
        assert all(name in out.stdout.replace('\\"', '"') for name in names), (values, out.stdout)


def test_label_values_given_as_booleans_or_numbers_are_text(helm_cli: Path) -> None:
    """A nodeSelector's and the monitoring objects' labels are strings to Kubernetes, which
    refuses `gpu: true`: `--set agent.nodeSelector.gpu=true` is written "true"."""
    out = _template(
        helm_cli,
        *_sets(
            {
                "agent.nodeSelector.gpu": "true",
                "webhook.nodeSelector.zone": 1,
                "monitoring.serviceMonitor.enabled": "true",
                "monitoring.serviceMonitor.labels.release": 1,
            }
        ),
    )
    assert out.returncode == 0, out.stderr
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(out.stdout) if doc}
    assert docs["DaemonSet"]["spec"]["template"]["spec"]["nodeSelector"] == {
        "gpu": "true",
        "nvidia.com/gpu.present": "true",
    }
    assert docs["Deployment"]["spec"]["template"]["spec"]["nodeSelector"] == {"zone": "1"}
    assert docs["ServiceMonitor"]["metadata"]["labels"]["release"] == "1"


def test_the_services_of_the_longest_release_name_are_dns_labels(helm_cli: Path) -> None:
    """Helm takes release names of up to 53 characters; with the chart's name after it, the
    webhook's Service was named 71 (the API server refuses over 63, helm lint does not)."""
    release = "gpu-pool-production-eu-west-1-" + "a" * 23
    assert len(release) == 53
    out = _run(helm_cli, "template", release, str(CHART), "--kube-version", "1.37.0")
    assert out.returncode == 0, out.stderr
    services = [
        doc["metadata"]["name"]
        for doc in yaml.safe_load_all(out.stdout)
        if doc and doc["kind"] == "Service"
    ]
    assert len(services) == 2 and all(len(name) <= 63 for name in services), services
