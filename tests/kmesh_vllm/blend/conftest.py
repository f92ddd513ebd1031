"""Blender fixtures: the tiny preset (session) and a small synthetic workload saved into a fresh cache."""

from __future__ import annotations

import pytest
import torch

from kmesh_vllm.model import load_model
from tests.helpers.blend_setup import build, small_workload


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the tiny model's ops are small: on a loaded machine, intra-op threads only wait for each other
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny():
    return load_model("tiny")


@pytest.fixture()
def setup(tiny):
    return build(tiny, small_workload())
