"""GPU tests run only where a real NVIDIA driver and a CUDA-enabled PyTorch are present."""

import pytest

from tests.gpu.probe import why_no_gpu


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if i.get_closest_marker("gpu") or "tests/gpu/" in str(i.fspath)]
    if not gpu_items:
        return
    reason = why_no_gpu()
    for item in gpu_items:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
