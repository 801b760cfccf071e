"""Test session setup: Triton interpreter on CPU-only hosts, and the ``gpu`` marker."""

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so this must run before anything
# imports memcli.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
