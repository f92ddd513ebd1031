"""What this host's CPU offers vLLM's CPU attention backend, read through the probes vLLM itself calls,
and vLLM's choice of attention ISA restated from it (so a test expects what vLLM does on *this* host).

vLLM 0.32 on x86-64:

- ``vllm/platforms/cpu.py:import_kernels`` loads one kernel library: ``_C`` (AVX-512 with BF16),
  ``_C_AVX512`` (AVX-512) or ``_C_AVX2`` (neither). The AVX2 library has neither the FP8 KV cache nor
  the ``amx`` kernels: its ``cpu_attn_reshape_and_cache`` answers "Unsupported CPU attention
  configuration" for them.
- ``vllm/v1/attention/backends/cpu_attn.py:_get_attn_isa``: a head size that is a multiple of 16 but
  not of 32 gets ``vec16`` (an FP8 KV cache is refused); an FP8 KV cache without AVX-512 or AMX is
  refused (NotImplementedError); AMX tiles with a bf16 model and a block size that is a multiple of 32
  get ``amx``; any other block size that is a multiple of 32 gets ``vec``, the rest ``vec16``.

Both read ``torch.cpu._is_avx512_supported()`` and ``torch.cpu._is_amx_tile_supported()``. torch's
AMX probe also asks the kernel for permission to use the tiles (``arch_prctl(ARCH_REQ_XCOMP_PERM)``),
which an ``amx_tile`` flag in /proc/cpuinfo does not show (a container or an older kernel can refuse
it), so the flags file is not read here.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

#: what vLLM's FP8 KV cache on CPU needs (its refusal names both)
FP8_NEEDS = "AVX-512 or AMX"


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU features vLLM's CPU attention decides on. ``capability``: torch's name for the vector
    instructions its own kernels use here (``AVX2``, ``AVX512``, ...), for messages."""

    arch: str
    avx512: bool
    amx_tile: bool
    capability: str

    @classmethod
    def of_this_host(cls) -> "CpuFeatures":
        """Read now, through the probes vLLM calls (a monkeypatched probe is seen)."""
        return cls(platform.machine(), bool(torch.cpu._is_avx512_supported()),
                   bool(torch.cpu._is_amx_tile_supported()), torch.backends.cpu.get_cpu_capability())

    @property
    def x86_64(self) -> bool:
        return self.arch in ("x86_64", "AMD64")

    def describe(self) -> str:
        if not self.x86_64:
            return self.arch
        have = [n for n, on in (("AVX-512", self.avx512), ("AMX", self.amx_tile)) if on]
        return f"x86-64 with {' and '.join(have)}" if have else f"x86-64 without AVX-512 or AMX ({self.capability})"


class CpuFeatureMissing(Exception):
    """vLLM refuses the configuration on this CPU; ``feature`` names what the CPU lacks."""

    def __init__(self, feature: str, cpu: CpuFeatures):
        super().__init__(f"needs {feature}; this host: {cpu.describe()}")
        self.feature = feature


def _is_quantized(kv_cache_dtype: str | None) -> bool:
    # vllm.utils.torch_utils.is_quantized_kv_cache
    return bool(kv_cache_dtype) and (kv_cache_dtype.startswith(("fp8", "nvfp4"))
                                     or kv_cache_dtype.endswith("per_token_head"))


def cpu_attn_isa(cpu: CpuFeatures, dtype: torch.dtype, block_size: int, head_size: int,
                 kv_cache_dtype: str = "auto") -> str:
    """The ISA vLLM's ``_get_attn_isa`` picks on an x86-64 ``cpu``; raises :class:`CpuFeatureMissing`
    where vLLM refuses (an FP8 KV cache without AVX-512 or AMX)."""
    if not cpu.x86_64:
        raise ValueError(f"cpu_attn_isa: the rule is restated for x86-64 only, got {cpu.arch}")
    quantized = _is_quantized(kv_cache_dtype)
    if head_size % 32 != 0 and head_size % 16 == 0:
        if quantized:
            raise ValueError(f"cpu_attn_isa: vLLM refuses an FP8 KV cache with head size {head_size} anywhere")
        return "vec16"
    if quantized and not (cpu.avx512 or cpu.amx_tile):
        raise CpuFeatureMissing(FP8_NEEDS, cpu)
    if cpu.amx_tile and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def missing_for_cache_write(cpu: CpuFeatures, isa: str, kv_cache_dtype: str = "auto") -> str | None:
    """What ``cpu`` lacks to run vLLM's ``cpu_attn_reshape_and_cache`` with ``isa`` and that cache
    dtype (None: nothing), judged by the kernel library vLLM loads for it."""
    if not cpu.x86_64:
        return "an x86-64 CPU (the vec/vec16/amx kernels)"
    if isa == "amx" and not cpu.amx_tile:
        return "AMX tiles (vLLM's amx kernels)"
    if _is_quantized(kv_cache_dtype) and not cpu.avx512:
        return "AVX-512 (vLLM's FP8 KV cache kernels are not in its AVX2 library)"
    return None
