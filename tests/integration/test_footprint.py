"""The sidecar runs in every enforced pod, so what it loads is memory paid once per pod.

Two things once cost 22 MiB of its 50 MiB budget: pynvml (the sidecar reads the agent by
default) and the kubernetes client's typed API classes (`CoreV1Api` alone is 20 MiB).
A fresh interpreter shows whether either comes back.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from kubernetes import client
from enforcer.modes import sidecar
from enforcer.edge.events import EventRecorder
from enforcer.edge.node_advertiser import NodeAdvertiser
from enforcer.edge.pod_watcher import PodWatcher

api = client.ApiClient()
PodWatcher(api, "ns", "pod", unexpected=None)
EventRecorder(api, "pod", "node", failures=None)
NodeAdvertiser(api, "node", resource_name="vram-enforcer.io/vram", resource_unit=1,
               reserve_bytes=0)
print(json.dumps(sorted(m for m in sys.modules
                        if m == "pynvml" or m.startswith("kubernetes.client.api."))))
"""


def test_the_sidecar_loads_neither_pynvml_nor_the_typed_api_classes() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == []


AGENT_FREE = """
import json, sys
from enforcer.modes import agent, sidecar, sidecar_access
from enforcer.edge.agent_link import AgentLink

sidecar_access.through_agent(AgentLink("/nonexistent.sock", 2.0, pod=True))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("kubernetes", "urllib3"))))
"""


def test_neither_a_sidecar_through_the_agent_nor_an_agent_without_the_api_loads_the_client() -> (
    None
):
    """The kubernetes client is half of a sidecar that reads the API itself (50.6 against
    28.1 MiB): a sidecar of the default `--api-access agent` never needs it, and neither
    does an agent that uses no API."""
    out = subprocess.run(
        [sys.executable, "-c", AGENT_FREE], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == []


OTHER_MODES = """
import json, sys
from enforcer.cli import build_parser, configure
args = build_parser("sidecar").parse_args(["sidecar"])
configure(args, {"POD_NAME": "p", "POD_NAMESPACE": "n", "POD_UID": "u", "NODE_NAME": "node",
                 "VRAM_ENFORCER_LIMITS": '{"c": 1}'})
from enforcer.modes import sidecar
print(json.dumps(sorted(m for m in sys.modules if m in ("jsonpatch", "statistics")
                        or m.startswith(("enforcer.core.admission", "enforcer.core.interference",
                                         "enforcer.core.settings.webhook")))))
"""


def test_the_sidecar_loads_no_other_modes_settings() -> None:
    """The command line declares only the chosen mode's settings: the webhook's bring the
    admission code, interference's `statistics` (1.5 MiB of the sidecar)."""
    out = subprocess.run(
        [sys.executable, "-c", OTHER_MODES], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == []


NO_EXPOSITION = """
import json, sys
from enforcer.cli import build_parser, configure
args = build_parser("sidecar").parse_args(["sidecar"])
configure(args, {"POD_NAME": "p", "POD_NAMESPACE": "n", "POD_UID": "u", "NODE_NAME": "node",
                 "VRAM_ENFORCER_LIMITS": '{"c": 1}'})
from enforcer.modes import sidecar, sidecar_access
from enforcer.edge.agent_link import AgentLink
from enforcer.edge.telemetry import SidecarTelemetry
sidecar_access.through_agent(AgentLink("/nonexistent.sock", 2.0, pod=True))
SidecarTelemetry().report()
print(json.dumps(sorted(m for m in sys.modules
                        if m.split(".")[0] in ("prometheus_client", "ssl", "wsgiref", "email")
                        or m.startswith("http."))))
"""


def test_the_sidecar_loads_no_metrics_exposition() -> None:
    """The agent serves every pod's metrics (issue 36): the sidecar has no listener, and
    prometheus_client's exposition (with the ssl, http.server and email it imports) was
    about 12 MiB of its 27."""
    out = subprocess.run(
        [sys.executable, "-c", NO_EXPOSITION], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == []
