"""The node agent's watch of its node's pods, against a stand-in API server on loopback: it
keeps of each pod only what it and the sidecars read, from the list and from the watch,
and lists a few pods at a time (a page is held whole until its pods are trimmed)."""

from __future__ import annotations

import json
import threading
from typing import Any, cast

from kubernetes import client

from enforcer.core.model import MiB
from enforcer.core.payloads import Pod
from enforcer.core.pod_directory import kept
from enforcer.edge.kube import api_client
from enforcer.edge.node_pods import NODE_PAGE, NodePods
from tests.helpers import wait_for
from tests.pods_api import serving


def large(index: int, cid: str) -> dict[str, Any]:
    """A tenant's running pod with 1 MiB of annotations, and the managedFields naming them."""
    keys = [f"tenant.example/a{i:05}" for i in range(MiB // 128)]
    return {
        "metadata": {
            "name": f"big-{index}",
            "namespace": "tenant",
            "uid": f"uid-{index}",
            "annotations": dict.fromkeys(keys, "x" * 100),
            "managedFields": [{"fieldsV1": {f"f:{k}": {} for k in keys}}],
        },
        "spec": {"containers": [{"name": "work", "image": "busybox", "env": [{"name": "E"}]}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [{"name": "work", "containerID": f"containerd://{cid}"}],
        },
    }


def test_the_agent_keeps_only_what_is_read_of_the_pods_it_lists_and_watches() -> None:
    pods = [large(i, f"{i:064x}") for i in range(12)]
    with serving([json.dumps(p).encode() for p in pods]) as api:
        config = client.Configuration()
        config.host, config.proxy = api.url, None
        changed = threading.Event()
        watched = NodePods(api_client(config), "gpu-1", (changed,))
        watched.start()
        try:
            wait_for(watched.snapshot, what="the list")
            assert watched.snapshot() == {p["metadata"]["uid"]: kept(cast(Pod, p)) for p in pods}
            assert api.pages == [NODE_PAGE] * 3  # 12 pods, in pages of 5
            wait_for(api.watching.is_set, what="the watch")
            restarted = large(0, "f" * 64)
            api.send("MODIFIED", restarted)
            wait_for(
                lambda: (watched.snapshot() or {}).get("uid-0") == kept(cast(Pod, restarted)),
                what="the change",
            )
            held = (watched.snapshot() or {})["uid-0"]
            assert "annotations" not in held["metadata"] and len(json.dumps(held)) < 512
        finally:
            watched.close()
            watched.join(timeout=10)
