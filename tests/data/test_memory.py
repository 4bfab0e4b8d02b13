"""What a device's memory allows (ddcnn/data/memory.py device_memory_bytes), as the memory plan reads it."""

from __future__ import annotations

import pytest
import torch

from ddcnn.data.memory import available_bytes, device_memory_bytes


def test_the_cpu_is_the_hosts_available_memory() -> None:
    assert device_memory_bytes("cpu") == pytest.approx(available_bytes(), rel=0.05)
    assert device_memory_bytes("cpu") > 0


def test_a_device_torch_does_not_see_or_know_has_no_figure() -> None:
    assert device_memory_bytes("mps") is None
    if not torch.cuda.is_available():
        assert device_memory_bytes("cuda") is None and device_memory_bytes("cuda:1") is None
    else:  # the GPU machine: the free memory of the device named
        free, total = torch.cuda.mem_get_info(0)
        assert 0 < device_memory_bytes("cuda:0") <= total
