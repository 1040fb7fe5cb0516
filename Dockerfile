# One image for every mode: the entrypoint is the console script, the mode is the first
# argument.
#
#   docker build -t "$IMAGE" .
#   docker run --rm "$IMAGE" webhook --help
#   docker run --rm --gpus all --pid=host "$IMAGE" exec --limit 4Gi -- CMD ...
#
# Behind a TLS-inspecting proxy (a corporate network), pip needs that proxy's CA and may
# need a pip configuration (an index mirror). Hand them to the build as secrets: they are
# mounted for the steps that download, and never stored in a layer of the image.
#
#   docker build --secret id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt \
#                --secret id=pip-conf,src=/etc/pip.conf -t "$IMAGE" .
#
# (buildah bud and podman build take the same --secret flags.) Without them, pip uses the
# base image's CA bundle and no configuration.
#
# How each mode runs it (docs/install.md, docs/security.md):
# - webhook: as the image's user, 65532, non-root, no capabilities.
# - sidecar: the webhook injects it with `command: [vram-enforcer, sidecar]`, runAsUser 0,
#   CAP_KILL only and readOnlyRootFilesystem: true. Nothing in the image is written at
#   run time: the bytecode is compiled here, and PYTHONDONTWRITEBYTECODE stops any attempt.
# - agent: the chart runs it as root with hostPID: true and the NVIDIA runtime.
#
# No NVML library is installed. nvidia-ml-py loads libnvidia-ml.so.1 at run time, and the
# NVIDIA container runtime injects the node driver's copy into containers that ask for GPUs
# (the agent; `docker run --gpus`). The sidecar reads usage from the agent's socket and
# needs no GPU. NVIDIA_VISIBLE_DEVICES is deliberately not set here, so the webhook and
# sidecar containers do not get the node's GPUs when nvidia is the default runtime.
#
# Both stages must use the same base image: the venv links /usr/local/bin/python and holds
# extensions built for that Python. To pin it by digest:
#   docker build --build-arg PYTHON_IMAGE=python:3.12-slim@sha256:<digest> ...
ARG PYTHON_IMAGE=python:3.12-slim


FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

# The runtime dependencies that pyproject.toml lists, pinned to the versions CI tests
# (`.venv/bin/pip freeze`). Only these are pinned: their own dependencies (urllib3,
# requests, PyYAML, ...) are resolved by pip at build time. Change a
# pin here together with the bound in pyproject.toml: tests/unit/test_image.py fails when
# the two disagree (a name missing on either side, or a pin outside its bound), and
# `pip check` below fails the build as well.
# --only-binary: the slim image has no compiler, so a missing wheel (for instance on a new
# architecture) fails here instead of half-building from source.
# The secrets: see the top of this file. A RUN step's environment is not kept in the image.
# This layer comes before the source is copied, so editing the code does not re-download it.
RUN --mount=type=secret,id=ca-bundle --mount=type=secret,id=pip-conf \
    if [ -f /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && if [ -f /run/secrets/pip-conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip-conf; fi \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install --only-binary=:all: \
        "nvidia-ml-py==13.615.71" \
        "psutil==7.2.2" \
        "kubernetes==37.0.2" \
        "prometheus-client==0.26.0" \
        "tenacity==9.2.1" \
        "grpcio==1.85.3"

# The build backend, pinned, in a venv of its own that never reaches the final image.
# pyproject.toml's build-system asks for setuptools>=77; the wheel is then built without
# build isolation, so nothing unpinned is fetched for the build either.
RUN --mount=type=secret,id=ca-bundle --mount=type=secret,id=pip-conf \
    if [ -f /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && if [ -f /run/secrets/pip-conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip-conf; fi \
 && python -m venv /opt/build \
 && /opt/build/bin/pip install "setuptools==84.0.0"

WORKDIR /src
# Only what the wheel is built from: the package and the metadata (readme = README.md,
# license-files = LICENSE, which the wheel and so the image carry).
COPY pyproject.toml README.md LICENSE ./
COPY enforcer/ ./enforcer/

# 1. Build the wheel and install it without its dependencies, which are already there.
# 2. pip check: every requirement of every installed distribution is met.
# 3. Drop kubernetes.aio (about 64 MiB with bytecode): the enforcer uses the synchronous
#    client only (enforcer/kube.py), and `import kubernetes` does not import aio. Re-check
#    this when the kubernetes pin moves; the import test in the final stage catches the rest.
# 4. Drop pip from the runtime venv: nothing installs at run time.
# 5. Compile all bytecode now, as unchecked-hash .pyc files: they stay valid whatever
#    timestamps COPY gives the sources, and a read-only root filesystem never needs a
#    __pycache__ write (which would be refused, leaving every start to recompile the
#    kubernetes client in memory).
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation -w /tmp/wheels . \
 && /opt/venv/bin/pip install --no-deps /tmp/wheels/vram_enforcer-*.whl \
 && /opt/venv/bin/pip check \
 && rm -rf /opt/venv/lib/python3.*/site-packages/kubernetes/aio \
 && /opt/venv/bin/pip uninstall --yes pip \
 && /opt/venv/bin/python -m compileall -q -f -j 0 --invalidation-mode unchecked-hash \
        /opt/venv/lib/python3.*/site-packages


FROM ${PYTHON_IMAGE}

# Labels: pass --build-arg REVISION=$(git rev-parse HEAD), and the build time with
# --label org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ).
ARG PYTHON_IMAGE
ARG VERSION=0.2.0
ARG REVISION=unknown
ARG SOURCE=https://github.com/vram-enforcer/vram-enforcer

LABEL org.opencontainers.image.title="vram-enforcer" \
      org.opencontainers.image.description="Per-container GPU memory (VRAM) limits for Kubernetes: node agent, in-pod sidecar, admission webhook, and exec for a single command" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"

# The default user. Numeric in USER below, so that kubelet can verify runAsNonRoot; named
# here, so that tools which look the uid up find it. No home directory: nothing is written.
RUN groupadd --gid 65532 nonroot \
 && useradd --uid 65532 --gid 65532 --no-create-home --no-log-init \
        --home-dir /nonexistent --shell /usr/sbin/nologin nonroot

COPY --from=builder /opt/venv /opt/venv

# glibc's malloc, told to give memory back: two arenas (not eight per core, each keeping
# what its threads freed) and every allocation of 128 KiB or more mmapped and returned at
# once (its threshold otherwise grows to the largest freed). Under a flood of 3 MiB reviews
# the webhook peaked at 112 MiB without these and 57 MiB with them (bench/flood_bench.py).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 \
    MALLOC_MMAP_THRESHOLD_=131072

# Smoke test of the copied venv on this base: the console script runs, every module of the
# package imports (kubernetes included, without kubernetes.aio), and so does grpc, which
# the agent loads only when it first reads the kubelet (its extension needs libstdc++.so.6
# from the base: a base without it failed there, at run time, not here). Writes nothing.
RUN vram-enforcer --version \
 && python -c "import grpc, importlib, pkgutil, enforcer; [importlib.import_module(m.name) for m in pkgutil.walk_packages(enforcer.__path__, 'enforcer.')]"

USER 65532:65532

ENTRYPOINT ["vram-enforcer"]
CMD ["--help"]
