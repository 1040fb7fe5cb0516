"""A stand-in for NVIDIA's device plugin (the outermost boundary): what the kubelet sees of
it over gRPC.

It registers `nvidia.com/gpu` with the kubelet (`v1beta1.Registration/Register`) and
lists the devices NVIDIA's plugin lists for a time-sliced GPU: `<UUID>::<n>` replicas of
it (`ListAndWatch`); `Allocate` answers each container with nothing to mount, as the fake
GPU needs nothing, or with its GPUs' CDI devices. The kubelet then counts the resource,
admits pods that ask for it, and lists which replica each container got on its
pod-resources socket, exactly as it does for the real plugin. The messages are written by hand (`tests/protowire.py`): the
plugin's API, `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from enforcer.core.pod_resources import fields
from tests.protowire import field

RESOURCE = "nvidia.com/gpu"
API = "v1beta1"
_SERVICE = f"{API}.DevicePlugin"
# Where the kubelet serves device plugins: fixed by the API (`DevicePluginPath`), whatever
# the kubelet's --root-dir (its pod-resources socket, by contrast, is below that).
PLUGINS = Path("/var/lib/kubelet/device-plugins")


class DevicePlugin:
    """Serving on `PLUGINS/<name>.sock` once made, registered with the kubelet there."""

    def __init__(
        self, ids: list[str], name: str = "vram-enforcer-test", cdi_kind: str | None = None
    ) -> None:
        """`cdi_kind`: answer each container with the CDI devices of its GPUs,
        `<cdi_kind>=<UUID>` (as NVIDIA's plugin does with its CDI spec), for the runtime to
        resolve; else with nothing."""
        self._ids = ids
        self._cdi_kind = cdi_kind
        self._stop = threading.Event()
        plugins = PLUGINS
        self.socket = plugins / f"{name}.sock"
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        as_is = {"request_deserializer": bytes, "response_serializer": bytes}
        handlers = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                lambda r, c: b"", **as_is
            ),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(self._list_and_watch, **as_is),
            "Allocate": grpc.unary_unary_rpc_method_handler(self._allocate, **as_is),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                lambda r, c: b"", **as_is
            ),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(lambda r, c: b"", **as_is),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, handlers),)
        )
        self._server.add_insecure_port(f"unix:{self.socket}")
        self._server.start()
        with grpc.insecure_channel(f"unix:{plugins / 'kubelet.sock'}") as channel:
            register = channel.unary_unary(
                f"/{API}.Registration/Register",
                request_serializer=bytes,
                response_deserializer=bytes,
            )
            register(field(1, API) + field(2, self.socket.name) + field(3, RESOURCE), timeout=10)

    def _list_and_watch(self, request: bytes, context: Any) -> Iterator[bytes]:
        """The devices once, all healthy; then open until the plugin stops."""
        yield b"".join(field(1, field(1, i) + field(2, "Healthy")) for i in self._ids)
        while not self._stop.wait(0.5) and context.is_active():
            pass

    def _allocate(self, request: bytes, context: Any) -> bytes:
        """One answer per container asked for (`container_requests`, field 1, each with its
        `devices_ids`, field 1): empty, or its GPUs' CDI devices (`cdi_devices`, field 5,
        each a `CDIDevice` whose `name` is field 1)."""
        answers = []
        for number, asked in fields(request):
            if number != 1 or not isinstance(asked, bytes):
                continue
            ids = [v.decode() for n, v in fields(asked) if n == 1 and isinstance(v, bytes)]
            gpus = dict.fromkeys(i.split("::")[0] for i in ids) if self._cdi_kind else {}
            answers.append(b"".join(field(5, field(1, f"{self._cdi_kind}={g}")) for g in gpus))
        return b"".join(field(1, answer) for answer in answers)

    def close(self) -> None:
        self._stop.set()
        self._server.stop(grace=None)
        self.socket.unlink(missing_ok=True)
