"""The model side's error: a config, checkpoint, GGUF file or runner argument KMesh refuses."""

from __future__ import annotations

from kmesh_gpu.errors import KmeshError


class ModelError(KmeshError, ValueError):
    """A model config, weight file, tokenizer or runner argument does not fit (the message names it)."""
