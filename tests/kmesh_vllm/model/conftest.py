"""Shared models for the model-side tests: the tiny preset (in memory and as a folder) and SmolLM2."""

from __future__ import annotations

import pytest

from kmesh_vllm.model import load_model, write_preset


@pytest.fixture(scope="session")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_preset("tiny", tmp_path_factory.mktemp("presets") / "tiny")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (converted once into the cache directory, then read from it)."""
    return load_model("smollm2-135m")
