"""``load_model``: a preset name, an HF model folder or a GGUF file, as a :class:`~.runner.Model`."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import ModelError
from .folder import read_folder
from .gguf_file import read_gguf
from .presets import PRESETS, PRETRAINED, pretrained_folder, random_checkpoint
from .runner import Model
from .weights import build_weights

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load_model(spec, *, device="cpu", dtype: torch.dtype = torch.float32) -> Model:
    """Load a model with its weights in ``dtype`` (fp32 default; bf16, fp16) on ``device``.

    ``spec``: a preset name (``smollm2-135m``, ``tiny``, ``qwen2.5-0.5b-shape``), an HF model folder,
    or a ``.gguf`` file (dequantised on load). Nothing is downloaded.
    """
    if dtype not in MODEL_DTYPES:
        raise ModelError(f"dtype: expected one of {MODEL_DTYPES}, got {dtype}")
    name = str(spec)
    if name in PRETRAINED:
        ckpt = read_folder(pretrained_folder(name))
    elif name in PRESETS:
        ckpt = random_checkpoint(name)
    else:
        path = Path(spec)
        if path.is_dir():
            ckpt = read_folder(path)
        elif path.is_file() and path.suffix == ".gguf":
            ckpt = read_gguf(path)
        else:
            raise ModelError(f"spec: {name!r} is neither a preset ({', '.join(PRESETS)}), a model folder nor a "
                             ".gguf file")
    weights = build_weights(ckpt.config, ckpt.tensors, dtype=dtype, device=device, source=ckpt.source)
    return Model(ckpt.config, weights, dtype=dtype, device=device, tokenizer=ckpt.tokenizer,
                 chat_template=ckpt.chat_template, name=name)
