"""Test set-up: the Triton interpreter on machines without a GPU, shared fixtures and markers."""

import os
import sys

import pytest

# Triton reads this at import: without a GPU, run Triton kernels in its CPU interpreter.
try:
    import torch

    _HAS_GPU = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_GPU = False
if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # tests/cases.py
# the kernel tests' helpers (writer_checks, attention_checks, the native emulation), for the
# sweeps in tests/ that reuse them
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "kernels"))


def pytest_collection_modifyitems(config, items):
    if _HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (none visible to torch)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
