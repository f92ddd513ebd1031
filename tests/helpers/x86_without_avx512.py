"""A pytest plugin that makes this host look, to torch and vLLM, like an x86-64 CPU without AVX-512 or
AMX (AMD EPYC before Zen 4, most desktop parts): ``pytest -p tests.helpers.x86_without_avx512 ...``.

Loaded before vLLM is imported, so vLLM's ``import_kernels`` loads its AVX2 kernel library (no FP8 KV
cache, no ``amx`` kernels) as on such a host, and its ISA choice reads the same probes. On a host that
really lacks the features nothing changes.
"""

import torch

# every probe of these features that vLLM 0.32 calls (grep torch.cpu._is_ in its sources), and torch's name
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
torch.cpu._is_amx_fp16_supported = lambda: False
torch.backends.cpu.get_cpu_capability = lambda: "AVX2"
