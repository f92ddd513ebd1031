"""Batched SHA-256 and kmesh-tree-sha256/v1 on the device: every backend equals hashlib and
kmesh_host.tree_digest, for boundary lengths, all alignments and multi-level trees; canaries outside
the messages; verification names the bad object; bad arguments are refused with named errors."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kmesh_gpu import BackendError, IntegrityError, LayoutError, sha256_batched, tree_digests, verify_tree_roots
from kmesh_gpu import _backend
from kmesh_gpu import _sha_plans
from kmesh_gpu import sha256 as sha_mod
from kmesh_host import tree_digest

CASES = [
    pytest.param("cpu", "host", id="cpu-host"),
    pytest.param("cpu", "warp", id="cpu-warp"),
    pytest.param("cuda", "host", id="cuda-host", marks=pytest.mark.gpu),
    pytest.param("cuda", "warp", id="cuda-warp", marks=pytest.mark.gpu),
    pytest.param("cuda", "cupy", id="cuda-cupy", marks=pytest.mark.gpu),
]
BOUNDARY_LENGTHS = [0, 1, 3, 55, 56, 57, 63, 64, 65, 119, 120, 121, 127, 128, 129, 1000]


def _need(device: str, backend: str) -> None:
    if backend == "cupy" and not _backend.has_cupy():
        pytest.skip("needs cupy with a CUDA device (not installed here)")
    if backend == "warp" and not _backend.has_warp():
        pytest.skip("needs the warp-lang package (not installed here)")


def _bytes(seed: int, n: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _hashlib(data: torch.Tensor, offs, lens) -> list[bytes]:
    raw = data.cpu().numpy().tobytes()
    return [hashlib.sha256(raw[o:o + n]).digest() for o, n in zip(offs, lens)]


def _rows(digests: torch.Tensor) -> list[bytes]:
    assert digests.dtype == torch.uint8 and digests.dim() == 2 and digests.shape[1] == 32
    return [bytes(r) for r in digests.cpu().numpy()]


@pytest.mark.parametrize("device,backend", CASES)
def test_known_vectors(device, backend):
    _need(device, backend)
    data = torch.tensor(list(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"), dtype=torch.uint8)
    got = sha256_batched(data.to(device), [0, 0, 0], [3, 0, 56], backend=backend)
    assert got.device.type == device
    assert [r.hex() for r in _rows(got)] == [
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
    ]


@pytest.mark.parametrize("device,backend", CASES)
def test_batched_boundary_lengths_every_alignment(device, backend):
    """Lengths around the padding boundaries, starting at every offset mod 16 (the three load paths)."""
    _need(device, backend)
    data = _bytes(1, 4096).to(device)
    offs, lens = [], []
    for n in BOUNDARY_LENGTHS:
        for shift in (0, 1, 2, 3, 4, 8, 13):
            offs.append(64 * len(offs) % 2048 + shift)
            lens.append(n)
    got = sha256_batched(data, np.array(offs, np.int64), torch.tensor(lens), backend=backend)
    assert _rows(got) == _hashlib(data, offs, lens)


@pytest.mark.parametrize("device,backend", CASES)
def test_batched_random_overlapping_messages(device, backend):
    _need(device, backend)
    rng = np.random.default_rng(2)
    data = _bytes(3, 50_000).to(device)
    lens = rng.integers(0, 5000, 120)
    offs = np.array([rng.integers(0, 50_000 - n + 1) for n in lens], dtype=np.int64)
    got = sha256_batched(data, torch.from_numpy(offs).to(device), lens.astype(np.int64), backend=backend)
    assert _rows(got) == _hashlib(data, offs.tolist(), lens.tolist())


@pytest.mark.parametrize("device,backend", CASES)
def test_canaries_outside_messages_do_not_matter(device, backend):
    """Bytes right before and after each message are never read; a flipped byte inside is seen."""
    _need(device, backend)
    data = _bytes(4, 3000)
    offs, lens = [16, 300, 1029, 2000], [200, 64, 55, 999]
    ref = sha256_batched(data, offs, lens, backend="host")
    poisoned = data.clone()
    for o, n in zip(offs, lens):
        poisoned[o - 1] ^= 0xFF
        poisoned[o + n] ^= 0xFF
    assert torch.equal(sha256_batched(poisoned.to(device), offs, lens, backend=backend).cpu(), ref)
    flipped = data.clone()
    flipped[1029 + 54] ^= 0x01
    got = sha256_batched(flipped.to(device), offs, lens, backend=backend).cpu()
    assert [torch.equal(got[i], ref[i]) for i in range(4)] == [True, True, False, True]


TREE_SHAPES = [
    pytest.param(64, 2, id="leaf64-fan2"),
    pytest.param(128, 3, id="leaf128-fan3"),
    pytest.param(256, 64, id="leaf256-fan64"),
]


def _tree_lengths(leaf: int, fanout: int) -> list[int]:
    span = leaf * fanout
    return sorted({0, 1, 55, 56, 63, 64, 119, 120, leaf - 1, leaf, leaf + 1, span - 1, span, span + 1,
                   span * fanout - 1, span * fanout + 1, 3 * span * fanout + 7})


@pytest.mark.parametrize("leaf,fanout", TREE_SHAPES)
@pytest.mark.parametrize("device,backend", CASES)
def test_tree_digests_equal_host_tree_digest(device, backend, leaf, fanout):
    """All objects of one call (different heights) in one launch per level, any offset alignment."""
    _need(device, backend)
    lens = _tree_lengths(leaf, fanout)
    offs, at = [], 0
    for i, n in enumerate(lens):
        offs.append(at + i % 5)
        at += n + 16
    data = _bytes(5, at + 16)
    raw = data.numpy().tobytes()
    want = [tree_digest(raw[o:o + n], leaf_size=leaf, fanout=fanout) for o, n in zip(offs, lens)]
    got = tree_digests(data.to(device), offs, lens, leaf_size=leaf, fanout=fanout, backend=backend)
    assert got.device.type == device
    assert _rows(got) == want


@pytest.mark.parametrize("device,backend", CASES)
def test_tree_digests_default_parameters(device, backend):
    _need(device, backend)
    leaf, span = 4096, 4096 * 64
    lens = [0, 5, leaf - 1, leaf, leaf + 1, span - 1, span, span + 1]
    offs = np.cumsum([0] + lens[:-1]).astype(np.int64)
    data = _bytes(6, int(sum(lens)))
    raw = data.numpy().tobytes()
    want = [tree_digest(raw[o:o + n]) for o, n in zip(offs.tolist(), lens)]
    assert _rows(tree_digests(data.to(device), offs, lens, backend=backend)) == want


@pytest.mark.parametrize("device,backend", CASES)
def test_verify_tree_roots_names_the_bad_object(device, backend):
    _need(device, backend)
    data = _bytes(7, 4 * 1000)
    offs, lens = [0, 1000, 2000, 3000], [1000, 1000, 1000, 999]
    names = ["seg-a", "seg-b", "seg-c", "seg-d"]
    roots = tree_digests(data, offs, lens, leaf_size=64, fanout=4, backend="host")
    on_device = data.to(device)
    verify_tree_roots(on_device, offs, lens, roots, names=names, leaf_size=64, fanout=4, backend=backend)
    verify_tree_roots(on_device, offs, lens, _rows(roots), leaf_size=64, fanout=4, backend=backend)
    on_device[2500] ^= 0x80
    on_device[3998] ^= 0x01
    with pytest.raises(IntegrityError, match=r"'seg-c' \(and 1 more of 4\)"):
        verify_tree_roots(on_device, offs, lens, roots.numpy(), names=names, leaf_size=64, fanout=4,
                          backend=backend)
    with pytest.raises(IntegrityError, match="object 2"):
        verify_tree_roots(on_device, offs, lens, roots, leaf_size=64, fanout=4, backend=backend)
    # Stored under other parameters: the roots differ, so verification refuses rather than passes.
    with pytest.raises(IntegrityError, match="object 0"):
        verify_tree_roots(data.to(device), offs, lens, roots, leaf_size=128, fanout=4, backend=backend)


def test_inputs_numpy_bytes_and_empty():
    payload = bytes(range(200))
    want = [hashlib.sha256(payload[10:150]).digest()]
    assert _rows(sha256_batched(payload, [10], [140])) == want
    assert _rows(sha256_batched(np.frombuffer(payload, np.uint8), np.array([10]), np.array([140]))) == want
    assert sha256_batched(payload, [], []).shape == (0, 32)
    assert tree_digests(payload, np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0, 32)
    empty = torch.zeros(0, dtype=torch.uint8)
    for backend in ("host", "warp"):
        assert _rows(tree_digests(empty, [0, 0], [0, 0], backend=backend)) == [tree_digest(b"")] * 2
        assert _rows(sha256_batched(empty, [0], [0], backend=backend)) == [hashlib.sha256(b"").digest()]


@pytest.mark.parametrize("call,match", [
    (lambda: sha256_batched(torch.zeros(8, dtype=torch.int32), [0], [1]), r"data: expected uint8\[M\]"),
    (lambda: sha256_batched(torch.zeros(2, 4, dtype=torch.uint8), [0], [1]), r"data: expected uint8\[M\]"),
    (lambda: sha256_batched(torch.zeros(8, dtype=torch.uint8)[::2], [0], [1]), "contiguous"),
    (lambda: sha256_batched(b"abcd", np.array([0], np.int32), [1]), r"offsets: expected int64\[N\]"),
    (lambda: sha256_batched(b"abcd", [0], torch.ones(1, 1, dtype=torch.int64)), r"lengths: expected int64\[N\]"),
    (lambda: sha256_batched(b"abcd", [0, 1], [1]), "same shape"),
    (lambda: sha256_batched(b"abcd", [-1], [1]), r"offsets\[0\] = -1"),
    (lambda: sha256_batched(b"abcd", [0, 0], [1, -2]), r"lengths\[1\] = -2"),
    (lambda: sha256_batched(b"abcd", [0, 2], [4, 3]), r"message 1 = data\[2:5\] runs past the end"),
    (lambda: sha256_batched(b"abcd", [0], [1], backend="fast"), "backend"),
    (lambda: tree_digests(b"abcd", [0], [4], leaf_size=100), "leaf_size"),
    (lambda: tree_digests(b"abcd", [0], [4], leaf_size=0), "leaf_size"),
    (lambda: tree_digests(b"abcd", [0], [4], leaf_size=True), "leaf_size"),
    (lambda: tree_digests(b"abcd", [0], [4], leaf_size=2 ** 31), "leaf_size"),
    (lambda: tree_digests(b"abcd", [0], [4], fanout=1), "fanout"),
    (lambda: tree_digests(b"abcd", [0], [4], fanout=2 ** 25), "fanout"),
    (lambda: tree_digests(b"abcd", [0], [4], fanout=4.0), "fanout"),
    (lambda: verify_tree_roots(b"abcd", [0], [4], [b"x" * 31]), "expected_roots"),
    (lambda: verify_tree_roots(b"abcd", [0], [4], torch.zeros(2, 32, dtype=torch.uint8)), "expected_roots"),
    (lambda: verify_tree_roots(b"abcd", [0], [4], [b"x" * 32], names=["a", "b"]), "names"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_are_named(call, match):
    with pytest.raises((LayoutError, IntegrityError, BackendError), match=match):
        call()


def test_cupy_refuses_cpu_data():
    with pytest.raises(BackendError, match="cupy"):
        sha256_batched(b"abcd", [0], [4], backend="cupy")


# -- The CUDA source's logic, compiled for the host ---------------------------------------------
# csrc/sha256.cu is framework-free; with a few lines that give the CUDA intrinsics their meaning on
# a CPU, g++ compiles it unchanged, so CI checks the fast kernels' logic (load paths, tail, tree
# levels, baseline) without a GPU. Threads are run one after another.

_SHIM = r"""
#include <stdint.h>
#include <string.h>
struct uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { uint4 v = {a, b, c, d}; return v; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__
#define __launch_bounds__(x)
struct kmesh_dim { unsigned x; };
static kmesh_dim threadIdx, blockIdx, blockDim;
template <class T> static inline T __ldg(const T* p) { T v; memcpy(&v, p, sizeof(T)); return v; }
template <class T> static inline T __ldcg(const T* p) { T v; memcpy(&v, p, sizeof(T)); return v; }
static inline void __threadfence() {}
static inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned old = *p; *p = old + v; return old; }
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
    return (unsigned)((((uint64_t)hi << 32) | lo) >> (sh & 31)); }
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = ((uint64_t)y << 32) | x; unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r; }
#include "SOURCE"
static void at_thread(long long t) { blockIdx.x = t / SHA256_THREADS; threadIdx.x = t % SHA256_THREADS; }
extern "C" void run_batched(const u8* d, const i64* o, const i64* l, u8* out, i64 n, int naive) {
    blockDim.x = SHA256_THREADS;
    for (long long t = 0; t < n; ++t) {
        at_thread(t);
        if (naive) kmesh_sha256_object_naive(d, o, l, out, n); else kmesh_sha256_batched(d, o, l, out, n);
    }
}
// Threads in an order given by the caller (a permutation of the leaves, then extra threads): whichever
// child comes last must hash the parent.
extern "C" void run_fused(const u8* data, const i64* table, i64 n_obj, i64 n_leaves, i64 leaf, i64 fanout,
                          u8* scratch, unsigned* counters, u8* out, int reset, const i64* order) {
    blockDim.x = SHA256_THREADS;
    for (long long t = 0; t < n_leaves + SHA256_THREADS; ++t) {
        at_thread(t < n_leaves ? order[t] : t);
        kmesh_sha256_tree_fused(data, table, n_obj, n_leaves, leaf, fanout, scratch, counters, out, reset);
    }
}
extern "C" void run_level(const u8* src, i64 piece, const i64* table, i64 n_obj, i64 n_msgs, u8* out) {
    blockDim.x = SHA256_THREADS;
    for (long long t = 0; t < n_msgs + SHA256_THREADS; ++t) {   // extra threads must exit untouched
        at_thread(t);
        kmesh_sha256_tree_level(src, piece, table, n_obj, n_msgs, out);
    }
}
"""


@pytest.fixture(scope="module")
def cuda_source_on_host(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++ to compile csrc/sha256.cu for the host (not installed)")
    source = Path(sha_mod.__file__).with_name("csrc") / "sha256.cu"
    work = tmp_path_factory.mktemp("sha256_host")
    (work / "shim.cpp").write_text(_SHIM.replace("SOURCE", str(source)))
    lib = work / "libsha256_host.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(lib), str(work / "shim.cpp")],
                   check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(lib))


def _p(a: np.ndarray, byte_offset: int = 0):
    return ctypes.c_void_p(a.ctypes.data + byte_offset)


@pytest.mark.parametrize("naive", [0, 1], ids=["batched", "one-thread-per-object"])
def test_cuda_source_batched_on_host(cuda_source_on_host, naive):
    data = _bytes(8, 6000).numpy()
    offs, lens = [], []
    for n in BOUNDARY_LENGTHS + [4095, 4096, 4097]:
        for shift in (0, 1, 2, 3, 4, 7, 8, 12):
            offs.append(17 * len(offs) % 1024 + shift)
            lens.append(n)
    offs, lens = np.array(offs, np.int64), np.array(lens, np.int64)
    out = np.zeros((offs.size, 32), np.uint8)
    cuda_source_on_host.run_batched(_p(data), _p(offs), _p(lens), _p(out), ctypes.c_longlong(offs.size),
                                    ctypes.c_int(naive))
    assert [bytes(r) for r in out] == _hashlib(torch.from_numpy(data), offs.tolist(), lens.tolist())


@pytest.mark.parametrize("leaf,fanout", TREE_SHAPES + [pytest.param(4096, 64, id="leaf4096-fan64")])
def test_cuda_source_tree_levels_on_host(cuda_source_on_host, leaf, fanout):
    """The tree launches exactly as kmesh_gpu issues them (same plan), run through the CUDA source."""
    lens = _tree_lengths(leaf, fanout) if leaf < 4096 else [0, 4097, 4096 * 64 + 1]
    offs = np.cumsum([3] + [n + 5 for n in lens[:-1]]).astype(np.int64)
    data = _bytes(9, int(offs[-1]) + lens[-1] + 8).numpy()
    plan = sha_mod._tree_plan(offs.tobytes(), np.array(lens, np.int64).tobytes(), leaf, fanout)
    buf = np.full(plan.total_bytes, 0xA5, np.uint8)            # poisoned: every digest must be written
    buf[:plan.host_bytes.size] = plan.host_bytes
    out = np.full((len(lens), 32), 0xA5, np.uint8)
    for lvl in plan.levels + (plan.root,):
        src = data if lvl.from_data else buf
        dst = out if lvl is plan.root else buf
        cuda_source_on_host.run_level(_p(src), ctypes.c_longlong(lvl.piece), _p(buf, 8 * lvl.table_at),
                                      ctypes.c_longlong(lvl.n_obj), ctypes.c_longlong(lvl.n_msgs), _p(dst))
    raw = data.tobytes()
    assert [bytes(r) for r in out] == [tree_digest(raw[o:o + n], leaf_size=leaf, fanout=fanout)
                                       for o, n in zip(offs.tolist(), lens)]


def _run_fused_on_host(lib, data: np.ndarray, offs, lens, leaf: int, fanout: int, *, reset: int = 1,
                       order_seed: int | None = None, counters: np.ndarray | None = None) -> list[bytes]:
    offs, lens = np.asarray(offs, np.int64), np.asarray(lens, np.int64)
    plan = sha_mod._fused_plan(offs.tobytes(), lens.tobytes(), leaf, fanout)
    table = np.ascontiguousarray(plan.table)
    scratch = np.full(32 * max(1, plan.n_slots), 0xA5, np.uint8)     # poisoned: every read digest is written
    if counters is None:
        counters = np.zeros(max(1, plan.n_counters), np.uint32)
    out = np.full((lens.size, 32), 0xA5, np.uint8)
    order = np.arange(plan.n_leaves, dtype=np.int64)
    if order_seed is not None:
        np.random.default_rng(order_seed).shuffle(order)
    lib.run_fused(_p(data), _p(table), ctypes.c_longlong(plan.n_obj), ctypes.c_longlong(plan.n_leaves),
                  ctypes.c_longlong(leaf), ctypes.c_longlong(fanout), _p(scratch), _p(counters), _p(out),
                  ctypes.c_int(reset), _p(order))
    return [bytes(r) for r in out]


@pytest.mark.parametrize("leaf,fanout", TREE_SHAPES + [pytest.param(4096, 64, id="leaf4096-fan64")])
@pytest.mark.parametrize("order_seed", [None, 1], ids=["in-order", "shuffled"])
def test_cuda_source_fused_tree_on_host(cuda_source_on_host, leaf, fanout, order_seed):
    """The one-launch tree kernel, threads run one after another in launch or shuffled order."""
    lens = _tree_lengths(leaf, fanout) if leaf < 4096 else [0, 1, 4095, 4096, 4097, 4096 * 64, 4096 * 64 + 1,
                                                           4096 * 64 * 2 + 100]
    offs = np.cumsum([3] + [n + 5 for n in lens[:-1]]).astype(np.int64)
    data = _bytes(9, int(offs[-1]) + lens[-1] + 8).numpy()
    raw = data.tobytes()
    want = [tree_digest(raw[o:o + n], leaf_size=leaf, fanout=fanout) for o, n in zip(offs.tolist(), lens)]
    assert _run_fused_on_host(cuda_source_on_host, data, offs, lens, leaf, fanout, order_seed=order_seed) == want


def test_cuda_source_fused_counters_reset_on_host(cuda_source_on_host):
    """With reset, the counters are zero again after a launch: the same buffer serves the next one."""
    data = _bytes(13, 300_000).numpy()
    raw = data.tobytes()
    offs, lens = [0, 16, 1000], [262_145, 4097, 200_000]
    want = [tree_digest(raw[o:o + n]) for o, n in zip(offs, lens)]
    plan = sha_mod._fused_plan(np.array(offs, np.int64).tobytes(), np.array(lens, np.int64).tobytes(), 4096, 64)
    counters = np.zeros(plan.n_counters, np.uint32)
    for seed in (None, 2, 3):
        assert _run_fused_on_host(cuda_source_on_host, data, offs, lens, 4096, 64, order_seed=seed,
                                  counters=counters) == want
        assert not counters.any()
    _run_fused_on_host(cuda_source_on_host, data, offs, lens, 4096, 64, reset=0, counters=counters)
    assert counters.any()                            # without reset the caller must clear them


@pytest.mark.parametrize("shift", [0, 1, 2, 3, 4, 8, 12])
def test_cuda_source_fused_unaligned_and_random_on_host(cuda_source_on_host, shift):
    rng = np.random.default_rng(20 + shift)
    lens = rng.integers(0, 3 * 4096 + 18, 40).tolist() + [0, 4096, 64 * 4096, 65 * 4096]
    offs = (np.cumsum([shift] + [n + 16 for n in lens[:-1]])).astype(np.int64)
    data = _bytes(14, int(offs[-1]) + lens[-1] + 8).numpy()
    raw = data.tobytes()
    want = [tree_digest(raw[o:o + n]) for o, n in zip(offs.tolist(), lens)]
    assert _run_fused_on_host(cuda_source_on_host, data, offs, lens, 4096, 64, order_seed=shift) == want


def test_cuda_source_fused_doc_vectors_on_host(cuda_source_on_host):
    pat = lambda n: (np.arange(n) % 251).astype(np.uint8)
    for n, leaf, fanout, root in _DOC_VECTORS:
        data = pat(n) if n != "abc" else np.frombuffer(b"abc", np.uint8).copy()
        size = data.size
        data = np.concatenate((data, np.zeros(16, np.uint8)))
        assert _run_fused_on_host(cuda_source_on_host, data, [0], [size], leaf, fanout) == [bytes.fromhex(root)]


# docs/tree-sha256.md test vectors: (payload length or "abc", leaf_size, fanout, root); payload pat(n).
_DOC_VECTORS = [
    (0, 4096, 64, "f827070984949eaa357cb8a7e4c45ce7259243db2560daf8d3e7e0253d2bedaf"),
    ("abc", 4096, 64, "398a25fb50c8654504e0d6d09fe5bfbcef547aae922bf26ab8b8bd5a13da343e"),
    ("abc", 64, 2, "7f7a07bd14c3579ae81f636c02c74e51011da0690a77dad47d86c9098328e4bc"),
    (4096, 4096, 64, "af7629c03b698e8de4c66180f7d33b1821f2c4a61c27c2779adca0f04b782cdb"),
    (4097, 4096, 64, "6e3d7b9f2060d615cbece6ba01bf910d2bc5e6d137e435e41a9c5dc5817a7045"),
    (262144, 4096, 64, "14560865f57b863cdd70874415db8797aadf3118752d52284832cdbd86cb4cde"),
    (262145, 4096, 64, "800b9993b578bc6dbebf18a50347c1ab8d7cd4efc4b16bd74b8dc212729f2039"),
    (3145728, 4096, 64, "da0d3cb026178532c98bbac5d151c301effaecb63ae89497bda3a99686a2918a"),
    (200, 64, 2, "4af2d850cec5c2e4c6e43d26b02e1ab1d44cf4c4eaecdd235f4fd81726820765"),
]


# -- The CuPy fast path's host side, with the launch run by the CUDA source compiled for the host ----
# CPU tensors stand in for device 0; the lane's CuPy function is replaced by a call into the host build
# of csrc/sha256.cu with exactly the argument tuple the lane built (pointers, counts, scratch, counters).


@pytest.fixture
def host_lane(monkeypatch, cuda_source_on_host):
    lib = cuda_source_on_host
    launches = []

    class HostFunction:
        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            assert block == (sha_mod._THREADS,) and stream is not None and stream.ptr == self.handle
            assert len(args) == 10 and all(type(a) in (np.uint64, np.int64, np.int32) for a in args)
            data, table, n_obj, n_leaves, leaf, fanout, scratch, counters, out, reset = (int(a) for a in args)
            assert grid == ((n_leaves + sha_mod._THREADS - 1) // sha_mod._THREADS,) and reset == 1
            order = np.arange(n_leaves, dtype=np.int64)
            lib.run_fused(ctypes.c_void_p(data), ctypes.c_void_p(table), ctypes.c_longlong(n_obj),
                          ctypes.c_longlong(n_leaves), ctypes.c_longlong(leaf), ctypes.c_longlong(fanout),
                          ctypes.c_void_p(scratch), ctypes.c_void_p(counters), ctypes.c_void_p(out),
                          ctypes.c_int(reset), _p(order))
            launches.append(args)

    def bind(lane):
        lane.fn = HostFunction()
        lane.fn.handle = lane.handle
        lane.stream = type("Stream", (), {"ptr": lane.handle})()
        lane.getdev = lambda: lane.index
        lane.device_ctx = None

    stream = {"handle": 1234}
    monkeypatch.setattr(sha_mod._Lane, "_bind", bind)
    monkeypatch.setattr(sha_mod, "_stream_handle", lambda index: stream["handle"])
    monkeypatch.setattr(sha_mod, "_resolve", lambda backend, device: "cupy")
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    for name in ("_LANES", "_VALIDATED", "_COUNTERS"):
        monkeypatch.setattr(sha_mod, name, {})
    checks = []
    real_messages = sha_mod._messages
    monkeypatch.setattr(sha_mod, "_messages", lambda *a: checks.append(1) or real_messages(*a))
    return launches, checks, stream


def test_fast_path_repeated_calls_launch_only(host_lane):
    launches, checks, _ = host_lane
    data = _bytes(80, 3 * 300_000 + 10)
    raw = data.numpy().tobytes()
    offs, lens = [0, 300_000, 600_003], [300_000, 262_145, 4097]
    want = [tree_digest(raw[o:o + n]) for o, n in zip(offs, lens)]
    kinds = [(offs, lens), (np.array(offs, np.int64), np.array(lens, np.int64)),
             (torch.tensor(offs), torch.tensor(lens))]
    for o, n in kinds:
        outs = [tree_digests(data, o, n) for _ in range(3)]
        assert all(_rows(r) == want for r in outs)
        assert len({r.data_ptr() for r in outs}) == 3          # a fresh output every call
    # Lists have their own key; numpy and torch share theirs (same bytes): one full call per key.
    assert len(checks) == 2 and len(launches) == 9
    assert len(sha_mod._LANES) == 1
    for c in sha_mod._COUNTERS.values():
        assert not c.any()                                      # self-resetting, as on the GPU
    # New data (same size) at the same places: hashed afresh, no stale pointer.
    other = _bytes(81, data.numel())
    assert _rows(tree_digests(other, offs, lens)) == [tree_digest(other.numpy().tobytes()[o:o + n])
                                                      for o, n in zip(offs, lens)]
    assert _rows(sha_mod._tree_digests_path(data, offs, lens, path="fused", counters="reset")) == want
    assert len(checks) == 2


def test_fast_path_keeps_every_check(host_lane):
    launches, checks, _ = host_lane
    data = _bytes(82, 10_000)
    offs, lens = np.array([0, 5000], np.int64), np.array([5000, 5000], np.int64)
    tree_digests(data, offs, lens)
    bad = [
        (lambda: tree_digests(data[:9_999], offs, lens), LayoutError, "runs past the end"),
        (lambda: tree_digests(data.view(torch.int8), offs, lens), LayoutError, r"data: expected uint8"),
        (lambda: tree_digests(data.view(2, -1), offs, lens), LayoutError, r"data: expected uint8"),
        (lambda: tree_digests(data, offs.reshape(2, 1), lens), LayoutError, r"offsets: expected int64\[N\]"),
        (lambda: tree_digests(data, offs.astype(">i8"), lens), LayoutError, r"offsets: expected int64\[N\]"),
        (lambda: tree_digests(data, [0, 5000], [5000, 5000.0]), LayoutError, "lengths"),
        (lambda: tree_digests(data, [False, 5000], [5000, 5000]), LayoutError, "offsets"),
        (lambda: tree_digests(data, offs, lens, leaf_size=4096.0), IntegrityError, "leaf_size"),
        (lambda: tree_digests(data, offs, lens, fanout=np.int64(64)), IntegrityError, "fanout"),
    ]
    tree_digests(data, offs.tolist(), lens.tolist())
    for call, exc, match in bad:
        with pytest.raises(exc, match=match):
            call()
    assert len(launches) == 2


def test_fast_path_new_offsets_reuse_the_shape_and_streams_get_lanes(host_lane):
    launches, checks, stream = host_lane
    data = _bytes(83, 200_000)
    raw = data.numpy().tobytes()
    hits = _sha_plans._fused_shape.cache_info().hits
    for o in (0, 1, 17, 4096, 100_000):
        assert _rows(tree_digests(data, [o], [70_000])) == [tree_digest(raw[o:o + 70_000])]
    assert _sha_plans._fused_shape.cache_info().hits >= hits + 4
    stream["handle"] = 5678                                     # another current stream: its own lane
    assert _rows(tree_digests(data, [3], [70_000])) == [tree_digest(raw[3:70_003])]
    assert set(sha_mod._LANES) == {(0, 1234), (0, 5678)} and set(sha_mod._COUNTERS) == set(sha_mod._LANES)
    # A bigger tree grows the lane's scratch; plans prepared before are prepared again, still right.
    big = _bytes(84, 5 << 20)
    assert _rows(tree_digests(big, [0], [5 << 20])) == [tree_digest(big.numpy().tobytes())]
    assert _rows(tree_digests(data, [3], [70_000])) == [tree_digest(raw[3:70_003])]
    for c in sha_mod._COUNTERS.values():
        assert not c.any()


def test_tree_launch_repeats_a_checked_digest_on_its_stream_only(host_lane):
    """``_tree_launch`` (the route's short path) writes the roots of a call that ``tree_digests``
    made before, with the same values and parameters, on the same stream, into the rows it is given,
    by one launch and no checks (one object or several); anything else launches nothing and says so."""
    launches, checks, stream = host_lane
    data = _bytes(85, 300_000)
    raw = data.numpy().tobytes()
    out = torch.zeros((3, 32), dtype=torch.uint8)
    assert not sha_mod._tree_launch(data, (7,), (70_000,), 4096, 64, 1234, out[1:2])  # never checked: no plan
    assert launches == [] and not out.any()
    tree_digests(data, [7], [70_000])  # checked once, on stream 1234
    n_checks, n_launches = len(checks), len(launches)
    assert sha_mod._tree_launch(data, (7,), (70_000,), 4096, 64, 1234, out[1:2])
    assert _rows(out[1:2]) == [tree_digest(raw[7:70_007])] and not out[0].any() and not out[2].any()
    assert len(checks) == n_checks and len(launches) == n_launches + 1
    for args in [(data, (8,), (70_000,), 4096, 64, 1234), (data, (7,), (70_001,), 4096, 64, 1234),
                 (data, (7,), (70_000,), 2048, 64, 1234), (data, (7,), (70_000,), 4096, 32, 1234),
                 (data, (7,), (70_000,), 4096, 64, 5678),  # another stream: its lane has not prepared this
                 (data[:70_006], (7,), (70_000,), 4096, 64, 1234)]:  # too short for the plan
        assert not sha_mod._tree_launch(*args, out[0:1])
    assert not sha_mod._tree_launch(data, (7,), (70_000,), 4096, 64, 1234, out[0:2])  # rows != objects
    assert len(launches) == n_launches + 1 and not out[0].any()
    # several objects in one launch, once checked together (not as a part of another call)
    assert not sha_mod._tree_launch(data, (0, 7), (10, 70_000), 4096, 64, 1234, out[0:2])
    tree_digests(data, [0, 7, 100_000], [10, 70_000, 200_000])
    assert not sha_mod._tree_launch(data, (0, 7), (10, 70_000), 4096, 64, 1234, out[0:2])
    out.zero_()
    assert sha_mod._tree_launch(data, (0, 7, 100_000), (10, 70_000, 200_000), 4096, 64, 1234, out)
    assert _rows(out) == [tree_digest(raw[0:10]), tree_digest(raw[7:70_007]), tree_digest(raw[100_000:300_000])]


# -- GPU: all backends agree, on the data's stream, with poisoned allocator memory ---------------

def _poison_cuda_allocator(nbytes: int) -> None:
    """Leave 0xA5 bytes in the caching allocator's free blocks, so unwritten outputs would show."""
    junk = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    del junk


@pytest.mark.gpu
def test_gpu_backends_agree_on_large_batch():
    if not _backend.has_cupy():
        pytest.skip("needs cupy with a CUDA device (not installed here)")
    rng = np.random.default_rng(10)
    host = _bytes(11, 4 * (3 << 20) + 64)
    lens = [3 << 20] * 4 + rng.integers(0, 70_000, 200).tolist()
    offs = [i * (3 << 20) for i in range(4)] + rng.integers(0, (3 << 20) * 3, 200).tolist()
    data = host.cuda()
    raw = host.numpy().tobytes()
    _poison_cuda_allocator(64 << 20)
    ref_sha = _hashlib(host, offs, lens)
    backends = ["cupy"] + (["warp"] if _backend.has_warp() else [])   # warp's part needs warp-lang
    for backend in backends:
        assert _rows(sha256_batched(data, offs, lens, backend=backend)) == ref_sha, backend
    ref_tree = [tree_digest(raw[o:o + n]) for o, n in zip(offs, lens)]
    for backend in backends:
        _poison_cuda_allocator(64 << 20)
        assert _rows(tree_digests(data, offs, lens, backend=backend)) == ref_tree, backend
        _poison_cuda_allocator(64 << 20)                        # again: the repeated-call fast path
        assert _rows(tree_digests(data, offs, lens, backend=backend)) == ref_tree, backend
    baseline = sha_mod._sha256_one_thread_per_object(data, offs[4:40], lens[4:40])
    assert _rows(baseline) == ref_sha[4:40]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "warp"])
def test_gpu_runs_on_the_current_stream(backend):
    """Data produced on a side stream is hashed after that copy, without an explicit sync."""
    _need("cuda", backend)
    host = _bytes(12, 8 << 20).pin_memory()
    want = tree_digest(host.numpy())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        data = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
        data.copy_(host, non_blocking=True)
        got = tree_digests(data, [0], [host.numel()], backend=backend)
        got_host = got.to("cpu", non_blocking=False)
    side.synchronize()
    assert bytes(got_host[0].numpy()) == want


# -- GPU: the one-launch tree (fused) against hashlib's reference, and against the per-level path ---

def _need_cupy() -> None:
    if not _backend.has_cupy():
        pytest.skip("needs cupy with a CUDA device (not installed here)")


def _reference_roots(raw: bytes, offs, lens, leaf: int = 4096, fanout: int = 64) -> list[bytes]:
    return [tree_digest(raw[o:o + n], leaf_size=leaf, fanout=fanout) for o, n in zip(offs, lens)]


FUSED_PATHS = [
    pytest.param("fused", "reset", id="fused-reset"),
    pytest.param("fused", "memset", id="fused-memset"),
    pytest.param("levels", None, id="levels"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("path,counters", FUSED_PATHS)
def test_gpu_tree_paths_doc_vectors(path, counters):
    _need_cupy()
    pat = lambda n: (np.arange(n) % 251).astype(np.uint8)
    for n, leaf, fanout, root in _DOC_VECTORS:
        host = pat(n) if n != "abc" else np.frombuffer(b"abc", np.uint8).copy()
        got = sha_mod._tree_digests_path(torch.from_numpy(host).cuda(), [0], [host.size], path=path,
                                         counters=counters, leaf_size=leaf, fanout=fanout)
        assert _rows(got) == [bytes.fromhex(root)], (n, leaf, fanout)
    # All vectors of one shape in one call, back to back in one buffer.
    vecs = [(n, root) for n, leaf, fanout, root in _DOC_VECTORS if (leaf, fanout) == (4096, 64)]
    parts = [pat(n) if n != "abc" else np.frombuffer(b"abc", np.uint8) for n, _ in vecs]
    lens = [p.size for p in parts]
    offs = np.cumsum([0] + lens[:-1]).astype(np.int64)
    got = sha_mod._tree_digests_path(torch.from_numpy(np.concatenate(parts)).cuda(), offs, lens, path=path,
                                     counters=counters)
    assert _rows(got) == [bytes.fromhex(r) for _, r in vecs]


@pytest.mark.gpu
@pytest.mark.parametrize("path,counters", FUSED_PATHS)
@pytest.mark.parametrize("shift", [0, 1, 3, 4, 8, 13])
def test_gpu_tree_paths_random_lengths_many_objects(path, counters, shift):
    """300 objects of random lengths 0 .. 3*4096+17 (one to four leaves), every start alignment."""
    _need_cupy()
    rng = np.random.default_rng(30 + shift)
    lens = rng.integers(0, 3 * 4096 + 18, 300).tolist() + [0, 0, 1, 63, 64, 4095, 4096, 4097, 3 * 4096 + 17]
    gaps = rng.integers(0, 40, len(lens))
    offs = np.cumsum([shift] + [n + int(g) for n, g in zip(lens[:-1], gaps[:-1])]).astype(np.int64)
    host = _bytes(31 + shift, int(offs[-1]) + lens[-1] + 16)
    _poison_cuda_allocator(64 << 20)
    got = sha_mod._tree_digests_path(host.cuda(), offs, lens, path=path, counters=counters)
    assert _rows(got) == _reference_roots(host.numpy().tobytes(), offs.tolist(), lens)


@pytest.mark.gpu
@pytest.mark.parametrize("path,counters", FUSED_PATHS)
@pytest.mark.parametrize("shift", [0, 5, 16])
def test_gpu_tree_paths_tree_shapes(path, counters, shift):
    """1, 64, 65 and 4097 leaves (one, two, three and three levels), partial last leaves, and a
    leaf count that is no multiple of the fanout, in one call with small objects in between."""
    _need_cupy()
    leaf = 4096
    lens = [leaf, 64 * leaf, 64 * leaf - 1, 65 * leaf, 65 * leaf - 7, 4097 * leaf, 4097 * leaf - 4095,
            4096 * leaf + 1, 0, 17, 3 * 64 * leaf + 5 * leaf + 3]
    offs = np.cumsum([shift] + [n + 48 + shift for n in lens[:-1]]).astype(np.int64)
    host = _bytes(40 + shift, int(offs[-1]) + lens[-1] + 16)
    got = sha_mod._tree_digests_path(host.cuda(), offs, lens, path=path, counters=counters)
    assert _rows(got) == _reference_roots(host.numpy().tobytes(), offs.tolist(), lens)


@pytest.mark.gpu
@pytest.mark.parametrize("path,counters", FUSED_PATHS)
@pytest.mark.parametrize("leaf,fanout", TREE_SHAPES + [pytest.param(64, 64, id="leaf64-fan64"),
                                                       pytest.param(4096, 2, id="leaf4096-fan2")])
def test_gpu_tree_paths_other_parameters(path, counters, leaf, fanout):
    _need_cupy()
    lens = _tree_lengths(leaf, fanout)
    offs = np.cumsum([7] + [n + 9 for n in lens[:-1]]).astype(np.int64)
    host = _bytes(50, int(offs[-1]) + lens[-1] + 16)
    got = sha_mod._tree_digests_path(host.cuda(), offs, lens, path=path, counters=counters,
                                     leaf_size=leaf, fanout=fanout)
    assert _rows(got) == _reference_roots(host.numpy().tobytes(), offs.tolist(), lens, leaf, fanout)


@pytest.mark.gpu
def test_gpu_fused_counters_stay_zero_across_calls_and_streams():
    """Self-resetting counters: many calls with different trees on two streams, interleaved, all right."""
    _need_cupy()
    rng = np.random.default_rng(60)
    host = _bytes(61, 24 << 20)
    raw = host.numpy().tobytes()
    data = host.cuda()
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    calls = []
    for k in range(12):
        n = int(rng.integers(1, 20))
        lens = rng.integers(0, 1 << 20, n)
        lens[0] = [1, 64 * 4096, 65 * 4096, 4097 * 4096][k % 4]
        offs = np.array([rng.integers(0, host.numel() - m + 1) for m in lens], dtype=np.int64)
        calls.append((offs, lens.astype(np.int64)))
    torch.cuda.synchronize()
    results = []
    for k, (offs, lens) in enumerate(calls):
        with torch.cuda.stream(streams[k % 2]):
            results.append(sha_mod._tree_digests_path(data, offs, lens, path="fused", counters="reset"))
    torch.cuda.synchronize()
    for (offs, lens), got in zip(calls, results):
        assert _rows(got) == _reference_roots(raw, offs.tolist(), lens.tolist())
    for c in sha_mod._COUNTERS.values():
        assert int(torch.count_nonzero(c)) == 0


@pytest.mark.gpu
def test_gpu_fused_is_the_default_cupy_tree_and_matches_levels_on_large_payload():
    """64 MiB + 12 MiB in one call: tree_digests (fused) equals the per-level path and the host."""
    _need_cupy()
    assert sha_mod._CUPY_TREE == "fused"
    host = _bytes(70, (64 << 20) + (12 << 20) + 3)
    offs, lens = [0, (64 << 20) + 3, (67 << 20) + 3, (70 << 20) + 3, (73 << 20) + 3], [64 << 20] + [3 << 20] * 4
    data = host.cuda()
    fused = _rows(tree_digests(data, offs, lens, backend="cupy"))
    levels = _rows(sha_mod._tree_digests_path(data, offs, lens, path="levels"))
    assert fused == levels == _reference_roots(host.numpy().tobytes(), offs, lens)


@pytest.mark.gpu
def test_driver_launch_matches_cupy_launch(monkeypatch):
    """The fused tree kernel launched through cuLaunchKernel gives CuPy's launch's roots (and the
    host reference's)."""
    from kmesh_gpu import _launch

    gen = torch.Generator().manual_seed(4)
    host = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=gen)
    data = host.cuda()
    offsets, lengths = [0, 1 << 20, (1 << 20) + 4096], [1 << 20, 4096, (2 << 20) - 4096]
    roots = {}
    for enabled in (True, False):
        monkeypatch.setattr(_launch, "ENABLED", enabled)
        roots[enabled] = tree_digests(data, offsets, lengths, backend="cupy").cpu()
    assert torch.equal(roots[True], roots[False])
    for i, (o, n) in enumerate(zip(offsets, lengths)):
        assert bytes(roots[True][i].tolist()) == tree_digest(host[o:o + n].numpy().tobytes())
