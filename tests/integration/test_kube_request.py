"""An API server that accepts the connection and never answers must not hold a thread.

The sidecar's pod watcher and event recorder each own a thread; before requests had a
timeout, one silent server stopped both for good.
"""

from __future__ import annotations

import socket
import threading

from kubernetes import client

from enforcer.kube import KubeError, call


def test_a_silent_api_server_is_an_error_not_a_hang() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        config = client.Configuration()
        config.host = f"http://127.0.0.1:{silent.getsockname()[1]}"
        config.proxy = None
        api = client.ApiClient(config)
        errors: list[str] = []

        def get() -> None:
            try:
                call(api, "GET", "/version", "version", timeout=0.2, deadline=0.1)
            except KubeError as exc:
                errors.append(str(exc))

        caller = threading.Thread(target=get, daemon=True)
        caller.start()
        caller.join(30)  # urllib3 makes four tries of 0.2 s each; without a timeout: never
        assert not caller.is_alive()
        assert len(errors) == 1 and "the API server is unreachable" in errors[0]
