"""kmesh_vllm.vllm_plugin: vLLM finds the entry point; the wrapper is installed once and records each
engine's model runner without keeping anything alive."""

from __future__ import annotations

import gc

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_discovers_the_entry_point():
    from vllm.plugins import load_plugins_by_group

    from kmesh_vllm import vllm_plugin

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert plugins.get("kmesh") is vllm_plugin.register, (
        "entry point vllm.general_plugins 'kmesh' not installed: reinstall the package (pip install -e .); a stale "
        "kmesh.egg-info beside the sources shadows the installed metadata")


def test_register_wraps_load_model_once():
    from vllm.v1.worker.gpu_worker import Worker

    from kmesh_vllm import vllm_plugin

    vllm_plugin.register()
    wrapped = Worker.load_model
    vllm_plugin.register()
    assert Worker.load_model is wrapped and wrapped.__kmesh_wrapped__
    assert wrapped.__wrapped__.__qualname__ == "Worker.load_model"


class _Config:
    pass


class _Runner:
    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model


def test_loaded_model_per_engine_config_and_weak():
    from kmesh_vllm import vllm_plugin

    a, b = _Config(), _Config()
    ra, rb = _Runner("model-a"), _Runner("model-b")
    vllm_plugin.remember(a, ra)
    vllm_plugin.remember(b, rb)
    assert (vllm_plugin.loaded_model(a), vllm_plugin.loaded_model(b)) == ("model-a", "model-b")
    assert vllm_plugin.loaded_model(_Config()) is None
    del rb
    gc.collect()
    assert vllm_plugin.loaded_model(b) is None  # the table kept the runner alive for nobody
