"""``tests/helpers/cpu_features.py`` on each kind of x86-64 host, this one pretending to be the others:
with torch's probes monkeypatched (the ones vLLM calls), vLLM's own ``_get_attn_isa`` decides as the
restated rule says, refusals included, and the CPU layout tests skip exactly the kernels such a host
lacks, naming the feature. The last test runs those tests where vLLM loaded its AVX2 kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.cpu_features import FP8_NEEDS, CpuFeatureMissing, CpuFeatures, cpu_attn_isa, missing_for_cache_write

pytestmark = pytest.mark.vllm

HOSTS = {
    "avx2": CpuFeatures("x86_64", avx512=False, amx_tile=False, capability="AVX2"),  # AMD EPYC Zen 2/3
    "avx512": CpuFeatures("x86_64", avx512=True, amx_tile=False, capability="AVX512"),  # Zen 4, Ice Lake
    "amx": CpuFeatures("x86_64", avx512=True, amx_tile=True, capability="AVX512"),  # Sapphire Rapids on
}
# (dtype, kv_cache_dtype, block size, head size) -> ISA per host (None: vLLM refuses, naming FP8_NEEDS)
WANT = {
    (torch.float32, "auto", 32, 64): {"avx2": "vec", "avx512": "vec", "amx": "vec"},
    (torch.bfloat16, "auto", 16, 128): {"avx2": "vec16", "avx512": "vec16", "amx": "vec16"},
    (torch.float16, "auto", 32, 80): {"avx2": "vec16", "avx512": "vec16", "amx": "vec16"},
    (torch.bfloat16, "auto", 64, 128): {"avx2": "vec", "avx512": "vec", "amx": "amx"},
    (torch.float16, "auto", 64, 128): {"avx2": "vec", "avx512": "vec", "amx": "vec"},
    (torch.bfloat16, "fp8", 32, 64): {"avx2": None, "avx512": "vec", "amx": "amx"},
    (torch.float32, "fp8_e5m2", 16, 64): {"avx2": None, "avx512": "vec16", "amx": "vec16"},
}
CASES = [(case, host) for case in WANT for host in HOSTS]
IDS = [f"{str(c[0]).split('.')[-1]}-{c[1]}-N{c[2]}-D{c[3]}-{h}" for c, h in CASES]


def pretend(monkeypatch, cpu: CpuFeatures) -> None:
    """torch's feature probes (those vLLM calls at decision time) answer as ``cpu`` would."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: cpu.avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: cpu.amx_tile)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cpu.capability)


@pytest.mark.parametrize("case, host", CASES, ids=IDS)
def test_the_rule_on_each_kind_of_host(case, host):
    dtype, kv_cache_dtype, N, D = case
    if WANT[case][host] is None:
        with pytest.raises(CpuFeatureMissing, match=FP8_NEEDS) as info:
            cpu_attn_isa(HOSTS[host], dtype, N, D, kv_cache_dtype)
        assert info.value.feature == FP8_NEEDS and "without AVX-512 or AMX (AVX2)" in str(info.value)
    else:
        assert cpu_attn_isa(HOSTS[host], dtype, N, D, kv_cache_dtype) == WANT[case][host]


@pytest.mark.skipif(not CpuFeatures.of_this_host().x86_64, reason="needs an x86-64 CPU (vLLM's x86 ISA rule)")
@pytest.mark.parametrize("case, host", CASES, ids=IDS)
def test_vllm_decides_as_the_rule_on_a_pretended_host(monkeypatch, case, host):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype, kv_cache_dtype, N, D = case
    pretend(monkeypatch, HOSTS[host])
    assert CpuFeatures.of_this_host() == HOSTS[host]
    if WANT[case][host] is None:
        with pytest.raises(NotImplementedError, match=FP8_NEEDS):
            _get_attn_isa(dtype, N, D, kv_cache_dtype)
    else:
        assert _get_attn_isa(dtype, N, D, kv_cache_dtype) == WANT[case][host]


def test_missing_kernels_are_named_per_host():
    need = {host: {(isa, kv): missing_for_cache_write(cpu, isa, kv) for isa in ("vec", "vec16", "amx")
                   for kv in ("auto", "fp8")} for host, cpu in HOSTS.items()}
    assert {k for k, v in need["amx"].items() if v} == set()
    assert {k for k, v in need["avx512"].items() if v} == {("amx", "auto"), ("amx", "fp8")}
    assert {k for k, v in need["avx2"].items() if v} == {("amx", "auto"), ("amx", "fp8"), ("vec", "fp8"),
                                                          ("vec16", "fp8")}
    assert need["avx2"]["vec", "fp8"].startswith("AVX-512") and need["avx512"]["amx", "auto"].startswith("AMX")
    assert missing_for_cache_write(CpuFeatures("aarch64", False, False, "DEFAULT"), "vec").startswith("an x86-64")


@pytest.mark.slow
@pytest.mark.skipif(not CpuFeatures.of_this_host().x86_64, reason="needs an x86-64 CPU (vLLM's AVX2 kernels)")
def test_cpu_layout_tests_pass_where_vllm_loads_its_avx2_kernels():
    """The CPU backend tests of test_vllm_layouts.py in a fresh process that vLLM takes for a host
    without AVX-512 or AMX (tests/helpers/x86_without_avx512.py): the FP8 and amx kernels are absent
    there, their tests skip naming the feature, the rest pass."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.helpers.x86_without_avx512", "-q", "-rs",
                          "-p", "no:cacheprovider", "tests/kmesh_vllm/test_vllm_layouts.py", "-k", "cpu"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert " 2 skipped" in out, out[-4000:]  # the FP8 write and the amx write
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert any("needs AVX-512" in line for line in skipped) and any("needs AMX tiles" in line for line in skipped)
    assert all("this host: x86-64 without AVX-512 or AMX (AVX2)" in line for line in skipped), skipped
