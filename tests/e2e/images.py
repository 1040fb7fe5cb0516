"""Container images for the real node, built here: there is no registry and no Docker.

- `image_archive` writes a one-layer OCI archive that `ctr images import` takes.
- `enforcer_image` is the project's image as the Dockerfile lays it out (a venv at
  /opt/venv holding the project's wheel and its runtime dependencies, the console script
  `vram-enforcer` as the entrypoint, user 65532), on the interpreter these tests run
  under instead of python:3.12-slim: its binary, its standard library and the shared
  libraries they load, found with ldd. The dependencies are pinned to the versions of the
  test environment (`pip freeze`), so the pods run what the rest of the suite tests.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ENFORCER_IMAGE = "localhost/vram-enforcer:e2e"
PYTHON = f"python{sys.version_info.major}.{sys.version_info.minor}"
# What the enforcer's modes never load: kept out of the image to keep it small.
_STDLIB_UNUSED = ("test", "site-packages", "config-*", "idlelib", "tkinter", "turtledemo",
                  "ensurepip", "lib2to3", "pydoc_data", "_tkinter*", "*.opt-1.pyc", "*.opt-2.pyc")  # fmt: skip


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
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return f"sha256:{digest}", len(data)

    layer_digest, layer_size = blob(layer.getvalue())
    image = {"architecture": "amd64", "os": "linux", "config": {"Entrypoint": entrypoint, **config},
             "rootfs": {"type": "layers", "diff_ids": [layer_digest]}}  # fmt: skip
    config_digest, config_size = blob(json.dumps(image).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}],
    }  # fmt: skip
    manifest_digest, manifest_size = blob(json.dumps(manifest).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
        "size": manifest_size, "annotations": {"io.containerd.image.name": ref}}]}  # fmt: skip
    with tarfile.open(path, "w") as t:
        entries = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": json.dumps(index).encode(),
                   **{f"blobs/sha256/{d}": data for d, data in blobs.items()}}  # fmt: skip
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            t.addfile(info, io.BytesIO(data))
    return path


def enforcer_image(work: Path) -> Path:
    """The project's image (`ENFORCER_IMAGE`) as an archive in `work`."""
    root = work / "rootfs"
    prefix = Path(sys.base_prefix)
    local = root / "usr" / "local"
    (local / "bin").mkdir(parents=True)
    shutil.copy2(Path(sys._base_executable).resolve(), local / "bin" / PYTHON)  # type: ignore[attr-defined]
    stdlib = local / "lib" / PYTHON
    shutil.copytree(prefix / "lib" / PYTHON, stdlib, ignore=shutil.ignore_patterns(*_STDLIB_UNUSED))
    (stdlib / "site-packages").mkdir()

    venv = root / "opt" / "venv"
    site = venv / "lib" / PYTHON / "site-packages"
    pins = work / "constraints.txt"
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    pins.write_text(frozen)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile",
                    "--disable-pip-version-check", "--target", str(site), "--constraint", str(pins),
                    str(ROOT)], check=True, capture_output=True, cwd=work)  # fmt: skip
    # As the Dockerfile does: no kubernetes.aio (the enforcer never imports it), no pip's
    # own scripts, and bytecode compiled now, valid whatever the files' times.
    shutil.rmtree(site / "kubernetes" / "aio", ignore_errors=True)
    shutil.rmtree(site / "bin", ignore_errors=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode",
                    "unchecked-hash", str(site)], check=True)  # fmt: skip
    (venv / "bin").mkdir()
    (venv / "bin" / "python").symlink_to(f"/usr/local/bin/{PYTHON}")
    (venv / "pyvenv.cfg").write_text(
        "home = /usr/local/bin\ninclude-system-site-packages = false\n"
    )
    script = venv / "bin" / "vram-enforcer"
    script.write_text(
        "#!/opt/venv/bin/python\nimport sys\nfrom enforcer.cli import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)

    for library, found in _shared_libraries([local / "bin" / PYTHON, *root.rglob("*.so*")]).items():
        dest = root / library.lstrip("/") if library.startswith("/lib64/") else (
            root / "usr" / "lib" / "x86_64-linux-gnu" / Path(library).name)  # fmt: skip
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            shutil.copy2(found, dest)
    env = ["PATH=/opt/venv/bin:/usr/local/bin:/usr/bin:/bin", "VIRTUAL_ENV=/opt/venv",
           "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1", "MALLOC_ARENA_MAX=2",
           "MALLOC_MMAP_THRESHOLD_=131072"]  # fmt: skip
    return image_archive(work / "enforcer.tar", ENFORCER_IMAGE, {"/": root}, ["vram-enforcer"],
                         Env=env, User="65532:65532", Cmd=["--help"])  # fmt: skip


def _shared_libraries(binaries: list[Path]) -> dict[str, Path]:
    """What `binaries` load, by the name they ask for (the loader by its absolute path),
    mapped to the file here. Libraries ldd cannot find are left out: their modules (tkinter's,
    say) are never imported by the enforcer."""
    found: dict[str, Path] = {}
    for binary in binaries:
        if binary.is_symlink() or not binary.is_file():
            continue
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if m := re.match(r"\s*(\S+) => (/\S+) \(", line):
                found[m[1]] = Path(os.path.realpath(m[2]))
            elif m := re.match(r"\s*(/\S+) \(", line):
                found[m[1]] = Path(os.path.realpath(m[1]))
    return found
