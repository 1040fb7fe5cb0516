"""Container images for the real node. There is no registry and no Docker engine here.

- `image_archive` writes a one-layer OCI archive that `ctr images import` takes (the pause
  image and other stand-ins).
- `enforcer_image` is the project's image, built from the Dockerfile with buildah
  (tests/e2e/build-image.sh) on a Debian base made by mmdebstrap: what users build is what
  the e2e pods run.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from tests.e2e.cluster import CACHE

ROOT = Path(__file__).resolve().parents[2]
ENFORCER_IMAGE = "localhost/vram-enforcer:e2e"


def image_archive(
    path: Path, ref: str, files: dict[str, Path], entrypoint: list[str], **config: Any
) -> Path:
    """A one-layer OCI image archive holding `files` (path in the image -> file or directory
    here; "/" takes a directory's contents as the root), with `config` (Env, User, ...)
    beside the entrypoint in the image's configuration."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        for dest, src in files.items():
            if dest == "/":
                for child in sorted(src.iterdir()):
                    t.add(str(child), arcname=child.name)
            else:
                t.add(str(src), arcname=dest.lstrip("/"))
    return _archive(path, ref, layer.getvalue(), entrypoint, **config)


def python_image(path: Path, ref: str) -> Path:
    """An image of Debian's python3 and nothing else (the base build-image.sh makes and
    caches, as its one layer): for stand-ins that need Python but not the project."""
    bases = sorted((CACHE / "image-base").glob("debian-*-python-*.tar"))
    if not bases:
        raise RuntimeError(
            f"no Python base in {CACHE / 'image-base'}: run tests/e2e/build-image.sh"
        )
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]
    return _archive(path, ref, bases[-1].read_bytes(), ["python3"], Env=env)


def _archive(path: Path, ref: str, layer: bytes, entrypoint: list[str], **config: Any) -> Path:
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return f"sha256:{digest}", len(data)

    layer_digest, layer_size = blob(layer)
    image = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, **config},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_digest, config_size = blob(json.dumps(image).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer_size,
            }
        ],
    }
    manifest_digest, manifest_size = blob(json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "annotations": {"io.containerd.image.name": ref},
            }
        ],
    }
    with tarfile.open(path, "w") as t:
        entries = {
            "oci-layout": b'{"imageLayoutVersion": "1.0.0"}',
            "index.json": json.dumps(index).encode(),
            **{f"blobs/sha256/{d}": data for d, data in blobs.items()},
        }
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            t.addfile(info, io.BytesIO(data))
    return path


def enforcer_image() -> Path:
    """The project's image (`ENFORCER_IMAGE`), built from the Dockerfile by
    tests/e2e/build-image.sh, as an archive for `ctr images import`. `.ci/run` builds it
    once and names it in VRAM_ENFORCER_IMAGE_ARCHIVE; without that, it is built here."""
    given = os.environ.get("VRAM_ENFORCER_IMAGE_ARCHIVE")
    if given:
        return Path(given)
    done = subprocess.run(
        ["bash", str(ROOT / "tests" / "e2e" / "build-image.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "VRAM_ENFORCER_IMAGE": ENFORCER_IMAGE},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the image did not build:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip())


def image_missing() -> str | None:
    """Why the image cannot be built here, or None."""
    if os.environ.get("VRAM_ENFORCER_IMAGE_ARCHIVE"):
        return None
    for tool in ("buildah", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"needs {tool} to build the image: apt-get install buildah mmdebstrap"
    return None
