"""KMesh's vLLM plugin: the entry point ``vllm.general_plugins`` -> ``kmesh`` (pyproject.toml).

vLLM runs :func:`register` in each of its processes before it builds an engine. It wraps the
worker's ``load_model`` (``vllm.v1.worker.gpu_worker.Worker``, which the CPU worker inherits) so
that, once the model is loaded, the worker's model runner is remembered for its engine
configuration; the KMesh connector's worker side, which vLLM constructs after ``load_model``
without a reference to the worker, finds the model with :func:`loaded_model`. Nothing of vLLM is
edited and nothing else changes: the wrapper calls the original and returns its result.
"""

from __future__ import annotations

import functools
import threading
import weakref

# vLLM constructs the worker connector with only the engine configuration, so the worker's model
# runner has to be found through a process-wide table: engine configuration -> its model runner
# (weak references both ways; the table keeps nothing alive).
_RUNNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_LOCK = threading.Lock()


def register() -> None:
    """Wrap ``Worker.load_model`` once per process (vLLM may call plugins more than once)."""
    from vllm.v1.worker.gpu_worker import Worker

    with _LOCK:
        original = Worker.load_model
        if getattr(original, "__kmesh_wrapped__", False):
            return

        @functools.wraps(original)
        def load_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            remember(self.vllm_config, self.model_runner)
            return result

        load_model.__kmesh_wrapped__ = True
        Worker.load_model = load_model


def remember(vllm_config, model_runner) -> None:
    """Record ``model_runner`` (with ``get_model()``) as the one of ``vllm_config``'s engine."""
    with _LOCK:
        for k in [k for k, (c, r) in _RUNNERS.items() if c() is None or r() is None]:
            del _RUNNERS[k]
        _RUNNERS[id(vllm_config)] = (weakref.ref(vllm_config), weakref.ref(model_runner))


def loaded_model(vllm_config):
    """The model (``nn.Module``) a worker of ``vllm_config``'s engine loaded in this process, or None
    (the plugin did not run here, or no model is loaded yet)."""
    with _LOCK:
        entry = _RUNNERS.get(id(vllm_config))
    if entry is None or entry[0]() is not vllm_config or entry[1]() is None:
        return None
    return entry[1]().get_model()
