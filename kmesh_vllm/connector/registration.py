"""vLLM's paged KV cache as KMesh addresses it, read from the tensors vLLM registers.

vLLM 0.32 allocates one buffer for the layers of a KV cache group and registers, per attention
layer, a ``[B, H, N, 2*D]`` view of it in the dtype of the cache (``create_kv_cache_views``); the
memory order of the logical ``[L, B, H, N, C]`` cache is the engine's resolved
``kv_cache_layout``. How a backend packs K and V inside ``C`` is the backend's own convention:

* ``CPU_ATTN`` with the ``vec``/``vec16`` ISAs (``cpu_attn.py``: the ``[B, H, N, 2D]`` view re-viewed
  as ``[B, H, 2N, D]`` and chunked; ``cpu_attn_reshape_and_cache`` writes K transposed): within each
  (block, head) a K plane ``[D, N]`` then a V plane ``[N, D]`` — ``kv_packing="planes"``. Its ``amx``
  ISA tiles the planes (no affine layout describes it) and is refused, as are ISAs of other CPU
  architectures, whose layout has not been checked.
* the GPU backends (FlashAttention, Triton, FlexAttention: ``transpose(1, 2).split(D, -1)``): K in
  the first D elements of ``C``, V in the next D — ``kv_packing="content"``.

:func:`register_caches` builds ``KVLayout.from_vllm(layout, ..., kv_packing=...)`` and checks every
registered tensor against it (dtype, shape, strides, where each layer starts), so a layout is never
assumed: a cache that differs is refused with what differs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kmesh_gpu import KVLayout
from kmesh_gpu.errors import LayoutError

from .config import ConnectorError

#: backend name -> how it packs K and V in the cache's last axis
BACKEND_PACKING = {"CPU_ATTN": "planes", "FLASH_ATTN": "content", "TRITON_ATTN": "content",
                   "FLEX_ATTENTION": "content"}
#: the CPU backend's ISAs whose writes are the affine "planes" packing (checked against
#: cpu_attn_reshape_and_cache in tests/kmesh_vllm/test_vllm_layouts.py)
PLANES_ISAS = ("vec", "vec16")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class RegisteredCache:
    """vLLM's cache for KMesh: ``layout`` (all layers) over ``cache``, a flat tensor over vLLM's
    buffer from layer 0's first element (``layout.extent`` elements; vLLM owns the memory). ``layer_names``
    in layer order; ``backend``, ``isa`` (CPU only, else None) as vLLM chose them."""

    layout: KVLayout
    cache: torch.Tensor
    layer_names: tuple[str, ...]
    backend: str
    isa: str | None


def layer_order(names) -> tuple[str, ...]:
    """vLLM's attention layer names (``model.layers.<i>.self_attn.attn``) in layer order; every
    layer ``0 .. L-1`` exactly once."""
    indexed = {}
    for n in names:
        m = _LAYER.search(n)
        if m is None:
            raise ConnectorError(f"kv_caches: layer name {n!r} holds no layer number (expected "
                                 "'...layers.<i>....')")
        i = int(m.group(1))
        if i in indexed:
            raise ConnectorError(f"kv_caches: layers {indexed[i]!r} and {n!r} have the same number {i}")
        indexed[i] = n
    if sorted(indexed) != list(range(len(indexed))):
        raise ConnectorError(f"kv_caches: layer numbers {sorted(indexed)} are not 0 .. {len(indexed) - 1}")
    return tuple(indexed[i] for i in range(len(indexed)))


def register_caches(kv_caches: Mapping[str, torch.Tensor], *, layout_name: str, backend: str, isa: str | None,
                    num_kv_heads: int, head_size: int, dtype: torch.dtype, cache_dtype: str) -> RegisteredCache:
    """Describe vLLM's registered ``kv_caches`` (layer name -> ``[B, H, N, 2*D]`` tensor) with one
    :class:`KVLayout`, or raise :class:`ConnectorError` saying why KMesh cannot address them.

    Args:
        layout_name: the engine's resolved ``kv_cache_layout`` (``"LBHNC"``, ...).
        backend: the attention backend's name (``"CPU_ATTN"``, ``"FLASH_ATTN"``, ...); ``isa``: the
            CPU backend's ISA (``layer.isa``), None elsewhere.
        num_kv_heads, head_size, dtype: the model's (per worker); ``cache_dtype``: vLLM's
            ``cache_dtype`` setting (``"auto"``: the model dtype; a quantised cache is refused).
    """
    if not kv_caches:
        raise ConnectorError("kv_caches: vLLM registered no KV cache tensor")
    names = layer_order(kv_caches)
    if cache_dtype != "auto":
        raise ConnectorError(f"cache_dtype: {cache_dtype!r}; the connector needs the KV cache in the model dtype "
                             "('auto'): quantised caches carry scales no saved segment has")
    packing = BACKEND_PACKING.get(backend)
    if packing is None:
        raise ConnectorError(f"attention backend {backend!r}: its cache packing is not known to KMesh (known: "
                             f"{sorted(BACKEND_PACKING)})")
    if packing == "planes" and isa not in PLANES_ISAS:
        why = ("tiles the K/V planes for AMX (a bf16 model with blocks of a multiple of 32 on an AMX host), which "
               "no affine KVLayout describes" if isa == "amx" else "writes a cache layout KMesh has not checked")
        raise ConnectorError(f"vLLM's CPU attention runs the {isa!r} ISA here: it {why}; KMesh addresses the "
                             f"{' and '.join(PLANES_ISAS)} ISAs only (e.g. a float32 or float16 model)")
    first = kv_caches[names[0]]
    if first.dim() != 4:
        raise ConnectorError(f"kv_caches[{names[0]!r}]: expected a [B, H, N, 2*D] tensor, got shape "
                             f"{tuple(first.shape)}")
    B, H, N, C = first.shape
    if (H, C) != (num_kv_heads, 2 * head_size):
        raise ConnectorError(f"kv_caches[{names[0]!r}]: shape {tuple(first.shape)} does not hold {num_kv_heads} KV "
                             f"heads of size {head_size} (expected [B, {num_kv_heads}, N, {2 * head_size}])")
    try:
        layout = KVLayout.from_vllm(layout_name, num_layers=len(names), num_blocks=B, block_size=N,
                                    num_kv_heads=H, head_size=head_size, dtype=dtype, kv_packing=packing)
    except LayoutError as exc:
        raise ConnectorError(f"kv_cache_layout {layout_name!r}: {exc}") from exc
    # Both packings keep each (block, head) tile [N, 2D] contiguous; V's strides name the tile's
    # block, head and layer steps in either packing.
    want_strides = (layout.v_strides[1], layout.v_strides[2], 2 * head_size, 1)
    itemsize = first.element_size()
    for i, name in enumerate(names):
        t = kv_caches[name]
        what = f"kv_caches[{name!r}]"
        if t.dtype != dtype or t.device != first.device or tuple(t.shape) != (B, H, N, C):
            raise ConnectorError(f"{what}: expected {str(dtype).removeprefix('torch.')}[{B}, {H}, {N}, {C}] on "
                                 f"{first.device}, got {str(t.dtype).removeprefix('torch.')}{list(t.shape)} on "
                                 f"{t.device}")
        if tuple(t.stride()) != want_strides:
            raise ConnectorError(f"{what}: strides {tuple(t.stride())} differ from the {layout.name} layout's "
                                 f"{want_strides}")
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            raise ConnectorError(f"{what}: not in the buffer of layer 0 (KMesh addresses the layers of one "
                                 "allocation)")
        if t.data_ptr() - first.data_ptr() != i * layout.v_strides[0] * itemsize:
            raise ConnectorError(f"{what}: starts {t.data_ptr() - first.data_ptr()} bytes after layer 0, the "
                                 f"{layout.name} layout puts layer {i} at {i * layout.v_strides[0] * itemsize}")
    held = first.untyped_storage().nbytes() // itemsize - first.storage_offset()
    if held < layout.extent:
        raise ConnectorError(f"kv_caches: the buffer holds {held} elements from layer 0, the {layout.name} layout "
                             f"addresses {layout.extent}")
    # vLLM allocates its caches in inference mode; a plain tensor over the same storage lets KMesh
    # write them from any thread (inference mode is per thread), vLLM sees the same memory.
    with torch.inference_mode(False):
        cache = torch.empty(0, dtype=dtype, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), (layout.extent,), (1,))
    return RegisteredCache(layout, cache, names, backend, isa if packing == "planes" else None)


def attention_facts(vllm_config, layer_names) -> tuple[str, str | None]:
    """The attention backend's name and (CPU backend) ISA vLLM chose for ``layer_names``, read from
    the layers in the engine's forward context; every layer must agree."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    missing = [n for n in layer_names if n not in layers]
    if missing:
        raise ConnectorError(f"kv_caches: {missing[0]!r} is not an attention layer of the model")
    facts = {(layer.attn_backend.get_name(), getattr(layer, "isa", None)) for layer in layers.values()}
    if len(facts) != 1:
        raise ConnectorError(f"attention layers: backends/ISAs differ between layers ({sorted(map(str, facts))})")
    return facts.pop()
