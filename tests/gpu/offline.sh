#!/usr/bin/env bash
# The GPU tests on a machine with a GPU and PyTorch but no network (a lab box, an
# air-gapped node, a lent cloud machine): bundle here, copy the checkout, run there.
#
#   bash tests/gpu/offline.sh bundle [PYTHON_VERSION]   # here, with network and the
#                                                       # binaries of build-kubernetes.sh
#   bash tests/gpu/offline.sh run [PYTEST ARGS...]      # there, as root, from the checkout
#   bash tests/gpu/offline.sh gate [PYTEST ARGS...]     # there: the allocation gate's GPU
#                                                       # questions alone (about 4 minutes)
#
# `bundle` writes .gpu-bundle/ (git-ignored, about 55 MiB): the project's runtime
# dependencies as wheels for the GPU machine's Python (3.12 by default; PyTorch, numpy,
# pytest and the like are expected there), and kube-apiserver, kube-controller-manager and
# etcd compressed, for tests/e2e/test_sidecar_gpu.py. `run` installs the wheels into
# /tmp/gpu-site (nothing of the machine's Python changes), unpacks the binaries into
# /tmp/gpu-bin, prints the enforcement tier the probe chooses here (with the driver and
# why), and runs tests/gpu and the GPU e2e test (default arguments: -s -v, every GPU test,
# the allocation gate's first; the interference matrix alone takes about 7 minutes on an
# H100). `gate` runs tests/gpu/test_allocation_gate_gpu.py only: its results go to
# .gpu-results/allocation-gate-<driver>.json, and a summary is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=.gpu-bundle
KUBE=${VRAM_ENFORCER_CACHE:-$HOME/.cache/vram-enforcer}/kubernetes-1.37.2
# What pyproject.toml depends on at run time, and what the kubernetes client needs that a
# GPU image usually lacks; pinned to what CI tests.
WHEELS=(kubernetes==37.0.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 typing-extensions==4.16.0 aiohttp-retry==2.9.1
        urllib3==2.8.0 durationpy==0.11 websocket-client==1.9.2 requests-oauthlib==2.0.0
        oauthlib==4.0.1 tenacity==9.2.1 jsonpatch==1.48 jsonpointer==3.12
        nvidia-ml-py==13.615.71)

# The wheels into /tmp/gpu-site (nothing of the machine's Python changes), and the GPU said.
setup() {
    [ -d "$BUNDLE/wheels" ] || { echo "no $BUNDLE: run 'bash tests/gpu/offline.sh bundle' where there is network" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-site "$BUNDLE"/wheels/*.whl
    export PYTHONPATH=/tmp/gpu-site:$PWD PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
}

case "${1:-}" in
bundle)
    version=${2:-3.12}
    mkdir -p "$BUNDLE/wheels"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$BUNDLE/wheels" "${WHEELS[@]}"
    for name in kube-apiserver kube-controller-manager etcd; do
        [ -x "$KUBE/$name" ] || { echo "no $KUBE/$name: run bash tests/e2e/build-kubernetes.sh" >&2; exit 2; }
        xz -T0 -6 -c "$KUBE/$name" > "$BUNDLE/$name.xz"
    done
    du -sh "$BUNDLE"
    ;;
run)
    shift
    setup
    mkdir -p /tmp/gpu-bin
    for name in kube-apiserver kube-controller-manager etcd; do
        [ -x "/tmp/gpu-bin/$name" ] || xz -dc "$BUNDLE/$name.xz" > "/tmp/gpu-bin/$name"
        chmod +x "/tmp/gpu-bin/$name"
    done
    export VRAM_ENFORCER_E2E=required
    export KUBE_APISERVER_BIN=/tmp/gpu-bin/kube-apiserver ETCD_BIN=/tmp/gpu-bin/etcd
    export KUBE_CONTROLLER_MANAGER_BIN=/tmp/gpu-bin/kube-controller-manager
    # The enforcement tier this machine gets, and why (docs/architecture.md, "Tiers"): the
    # probe reads, never sets. Said before the tests, whatever they do.
    python3 -c '
from enforcer.core.tier_choice import choose
from enforcer.edge.nvml import Nvml
from enforcer.edge.tier_probe import TierProbe, host_root, own_cgroup
nvml = Nvml()
try:
    probe = TierProbe(own_cgroup, host_root()).probe(nvml)
finally:
    nvml.shutdown()
driver = probe.driver_version or "(none)"
print(f"tier probe: driver {driver}, per-cgroup calls {probe.limit_calls}")
print(f"tier probe: {choose(probe).said()}")
' || echo "tier probe: failed (above); the tests go on" >&2
    [ $# -gt 0 ] || set -- -s -v tests/gpu/test_allocation_gate_gpu.py tests/gpu tests/e2e/test_sidecar_gpu.py
    exec python3 -m pytest -p no:cacheprovider "$@"
    ;;
gate)    # about 4 minutes: the allocation gate's GPU questions (docs/architecture.md)
    shift
    setup
    exec python3 -m pytest -p no:cacheprovider -s -v tests/gpu/test_allocation_gate_gpu.py "$@"
    ;;
*)
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
