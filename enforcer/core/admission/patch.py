"""A JSON patch (RFC 6902) built as the pod is changed, one operation at each path that
changes (pure)."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from enforcer.core.admission.common import Path
from enforcer.core.payloads import (
    PatchOperation,
)


class Patch:
    """The pod as mutated, and the JSON patch (RFC 6902) that makes it so, built together:
    each change is made to a working copy and recorded as one operation at the path it
    changes. (A diff of the whole pod after, `jsonpatch.make_patch`, took about 1 s of CPU
    for a pod of 3 MiB, 5 s in issue 35's report: a few such creates starved admission.)
    Only the maps and lists on a changed path are copied; the rest is the pod as sent,
    shared and never written. A change to what is already there records nothing, so a
    pass over our own output yields no patch."""

    def __init__(self, pod: Mapping[str, object]) -> None:
        self.ops: list[PatchOperation] = []
        self._doc: dict[str, Any] = dict(pod)
        self._copies = {id(self._doc): self._doc}  # held, so that no id is reused

    def get(self, path: Path) -> Any:
        """What `path` holds now (None: nothing), to read: it changes only through here."""
        doc: Any = self._doc
        for key in path:
            if isinstance(doc, dict):
                doc = doc.get(key)
            elif isinstance(doc, list) and isinstance(key, int) and key < len(doc):
                doc = doc[key]
            else:
                return None
        return doc

    def set(self, path: Path, value: object) -> None:
        """Add or replace a map's member (the maps above it made where absent or null), or
        replace a list's item."""
        for depth, key in enumerate(path[:-1]):
            holder = self.get(path[:depth])
            if isinstance(holder, dict) and holder.get(key) is None:
                for above in reversed(path[depth + 1 :]):
                    value = {above: value}
                path = path[: depth + 1]
                break
        parent, key = self._parent(path), path[-1]
        present = not isinstance(parent, dict) or key in parent
        if present and _same(parent[key], value):
            return
        parent[key] = value
        self._record("replace" if present else "add", path, value)

    def insert(self, path: Path, value: object) -> None:
        """Insert into a list at the index that ends `path` (its length: at the end)."""
        self._parent(path).insert(path[-1], value)
        self._record("add", path, value)

    def append(self, path: Path, value: object) -> None:
        """Add to the end of the list that the map member at `path` holds (or is made of)."""
        items = self.get(path)
        if items is None:
            self.set(path, [value])
        else:
            self.insert((*path, len(items)), value)

    def remove(self, path: Path) -> None:
        del self._parent(path)[path[-1]]
        self.ops.append({"op": "remove", "path": _pointer(path)})

    def _parent(self, path: Path) -> Any:
        """The map or list that holds `path`'s last key, each one down to it copied once."""
        doc: Any = self._doc
        for key in path[:-1]:
            child = doc[key]
            if id(child) not in self._copies:
                child = copy.copy(child)
                self._copies[id(child)] = doc[key] = child
            doc = child
        return doc

    def _record(self, op: str, path: Path, value: object) -> None:
        # `value` is never written after: a later change below it copies it first.
        self.ops.append({"op": op, "path": _pointer(path), "value": value})


def _pointer(path: Path) -> str:
    """A JSON pointer (RFC 6901): `~` and `/` in a key (an annotation's) escaped."""
    return "".join("/" + str(key).replace("~", "~0").replace("/", "~1") for key in path)


def _same(a: object, b: object) -> bool:
    """Equal as JSON (in Python, `True == 1`)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def put(patch: Patch, path: Path, item: Mapping[str, Any], at: int | None = None) -> None:
    """Replace the entry of the list at `path` with `item`'s name in place, or add it at
    `at` (None: at the end). In place, so that a pass over our own output leaves the order
    others gave it; but an entry that must be at `at` (the native sidecar, first of the init
    containers) is moved there: a pod that declared its own `vram-enforcer` third would
    otherwise run two init containers before the sidecar exists."""
    items = patch.get(path) or ()
    for i, existing in enumerate(items):
        if existing.get("name") == item["name"]:
            if at is None or i == at:
                patch.set((*path, i), item)
            else:
                patch.remove((*path, i))
                patch.insert((*path, at), item)
            return
    if at is None or not items:
        patch.append(path, item)
    else:
        patch.insert((*path, at), item)
