"""A stand-in for the kubelet's pod-resources API (the outermost boundary): a real gRPC
server on a Unix socket that answers `List`, for the agent's reader and `doctor`."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc

from enforcer.edge.pod_resources import LIST
from tests.protowire import field


def reply(replica: str) -> bytes:
    devices = field(2, field(1, "nvidia.com/gpu") + field(2, replica))
    return field(1, field(1, "serve-0") + field(2, "ml") + field(3, field(1, "server") + devices))


class Kubelet:
    """Answers `List` with `answer` until stopped."""

    def __init__(self, socket: Path) -> None:
        self.answer = reply("GPU-a::0")
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        service, method = LIST.strip("/").split("/")
        handler = grpc.unary_unary_rpc_method_handler(
            self._list, request_deserializer=bytes, response_serializer=bytes
        )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        self._server.add_insecure_port(f"unix:{socket}")
        self._server.start()

    def _list(self, request: bytes, context: object) -> bytes:
        return self.answer

    def stop(self) -> None:
        self._server.stop(grace=None)
