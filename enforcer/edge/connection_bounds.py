"""How many connections a threaded server holds at once: in all, and from one address.

A thread per connection, unbounded, lets whoever reaches a port grow the process by a
thread (and its memory) per connection it opens and leaves idle. With a bound per peer
address and one in all, a flood from one address is closed at once and costs the others
nothing; a connection past either bound is closed before a thread is started for it.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class BoundedConnections:
    """A `socketserver` mixin (first among the bases): `connections` at once in all, and
    `per_peer` at once from one address."""

    connections = 32
    per_peer = 4

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open: Counter[str] = Counter()
        self._admitted: dict[int, str] = {}
        self._bounds = threading.Lock()
        self.refused = 0  # connections closed at once, past a bound
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0]) if isinstance(client_address, tuple) else ""
        with self._bounds:
            full = self._open.total() >= self.connections or self._open[peer] >= self.per_peer
            if full:
                self.refused += 1
            else:
                self._open[peer] += 1
                self._admitted[id(request)] = peer
        if full:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)  # type: ignore[misc]

    def shutdown_request(self, request: Any) -> None:
        with self._bounds:
            peer = self._admitted.pop(id(request), None)
            if peer is not None:
                self._open[peer] -= 1
                if not self._open[peer]:
                    del self._open[peer]
        super().shutdown_request(request)  # type: ignore[misc]
