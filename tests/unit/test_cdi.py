"""NVIDIA's memory-limit hook, as a CDI spec names it."""

from __future__ import annotations

from enforcer.core.cdi import memory_limit_hook_gpus


def hook_spec(gpu: str) -> str:
    """A spec as `nvidia-ctk cdi generate` writes it (YAML), whose GPU runs the hook."""
    return f"""\
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    hooks:
    - hookName: createRuntime
      path: /usr/bin/nvidia-cdi-hook
      args:
      - nvidia-cdi-hook
      - apply-cuda-memory-limits
      - --driver-root
      - /
      - --gpu-id
      - {gpu}
"""


def test_the_toolkit_hook_is_found_in_a_yaml_or_json_cdi_spec() -> None:
    yaml_spec = hook_spec("GPU-4a6f-01")
    json_spec = (
        '{"devices": [{"containerEdits": {"hooks": [{"hookName": "createRuntime", "args": '
        '["nvidia-ctk", "hook", "apply-cuda-memory-limits", "--driver-root", "/", '
        '"--gpu-id", "GPU-4a6f-02"]}]}}]}'
    )
    assert memory_limit_hook_gpus(yaml_spec) == ("GPU-4a6f-01",)
    assert memory_limit_hook_gpus(json_spec) == ("GPU-4a6f-02",)
    assert memory_limit_hook_gpus(yaml_spec.replace("apply-cuda-memory-limits", "x")) == ()
