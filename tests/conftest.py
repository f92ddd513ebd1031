"""Shared test configuration: GPU tests skip cleanly (named reason) where no CUDA device exists."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (none here)"))
        if "vllm" in item.keywords:
            try:
                import vllm  # noqa: F401
            except Exception:
                item.add_marker(pytest.mark.skip(reason="needs the vllm package (not installed)"))

