"""Which internal path a digest takes (kmesh_gpu.sha256 and csrc/sha256.cu), each path's bits, and
the short path of repeated calls. The only test file that looks inside the digest.

* The CUDA source compiled for the host (a few lines give the intrinsics a CPU meaning; g++
  compiles csrc/sha256.cu unchanged): the batched kernel, the per-level tree kernel and the fused
  one-launch tree kernel (threads in launch order or shuffled: whichever child finishes last hashes
  the parent; counters that reset themselves), against hashlib and the tree reference; and the
  perf baseline's one-thread-per-object kernel (perf/csrc/sha256_naive.cu).
* The CuPy fast path's host side with its launch run by that host build: a repeated call is one
  launch (no checks, no plan work), keeps every check that guards it, gets a launcher per stream;
  a repeated call on a raw stream into ``out`` (``tree_digests(out=, stream=)``) is one launch and
  writes only into an ``out`` it accepts.
* On a GPU (``-m gpu``): the fused and the per-level paths against the published vectors and the
  reference over random lengths, tree shapes and parameters; which path ``tree_digests`` takes by
  size; the kernel launched through the driver or, where the driver refuses, through CuPy.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kmesh_gpu import IntegrityError, LayoutError, tree_digests
from kmesh_gpu import _backend, _sha_plans, cuda
from kmesh_gpu import sha256 as sha_mod
from tests.helpers.tree_reference import DOC_VECTORS, doc_payload, tree_digest
from tests.kmesh_gpu.test_sha256 import (BOUNDARY_LENGTHS, TREE_SHAPES, _bytes, _hashlib, _poison_cuda_allocator,
                                         _rows, _tree_lengths)


# -- The CUDA source's logic, compiled for the host ---------------------------------------------
# csrc/sha256.cu is framework-free; with a few lines that give the CUDA intrinsics their meaning on
# a CPU, g++ compiles it unchanged, so CI checks the fast kernels' logic (load paths, tail, tree
# levels) without a GPU, and the perf baseline's kernel the same way. Threads run one after another.

_PRELUDE = r"""
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
"""

_SHIM = _PRELUDE + r"""
#include "SOURCE"
static void at_thread(long long t) { blockIdx.x = t / SHA256_THREADS; threadIdx.x = t % SHA256_THREADS; }
extern "C" void run_batched(const u8* d, const i64* o, const i64* l, u8* out, i64 n) {
    blockDim.x = SHA256_THREADS;
    for (long long t = 0; t < n; ++t) {
        at_thread(t);
        kmesh_sha256_batched(d, o, l, out, n);
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

# perf/csrc/sha256_naive.cu (the seed's design, perf/run_sha256.py's baseline), one thread at a time
_NAIVE_SHIM = _PRELUDE + r"""
#include "SOURCE"
extern "C" void run_naive(const u8* d, const i64* o, const i64* l, u8* out, i64 n) {
    blockDim.x = 128;
    for (long long t = 0; t < n; ++t) {
        blockIdx.x = t / 128; threadIdx.x = t % 128;
        kmesh_sha256_object_naive(d, o, l, out, n);
    }
}
"""


def _host_build(tmp_path_factory, shim: str, source: Path, name: str):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip(f"needs g++ to compile {source.name} for the host (not installed)")
    work = tmp_path_factory.mktemp(name)
    (work / "shim.cpp").write_text(shim.replace("SOURCE", str(source)))
    lib = work / f"lib{name}.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(lib), str(work / "shim.cpp")],
                   check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module")
def cuda_source_on_host(tmp_path_factory):
    return _host_build(tmp_path_factory, _SHIM, Path(sha_mod.__file__).with_name("csrc") / "sha256.cu", "sha256_host")


@pytest.fixture(scope="module")
def naive_source_on_host(tmp_path_factory):
    root = Path(sha_mod.__file__).resolve().parents[1]
    return _host_build(tmp_path_factory, _NAIVE_SHIM, root / "perf" / "csrc" / "sha256_naive.cu", "sha256_naive")


def _p(a: np.ndarray, byte_offset: int = 0):
    return ctypes.c_void_p(a.ctypes.data + byte_offset)


@pytest.mark.parametrize("kernel", ["batched", "one-thread-per-object"])
def test_cuda_source_batched_on_host(request, kernel):
    lib = request.getfixturevalue("cuda_source_on_host" if kernel == "batched" else "naive_source_on_host")
    run = lib.run_batched if kernel == "batched" else lib.run_naive
    data = _bytes(8, 6000).numpy()
    offs, lens = [], []
    for n in BOUNDARY_LENGTHS + [4095, 4096, 4097]:
        for shift in (0, 1, 2, 3, 4, 7, 8, 12):
            offs.append(17 * len(offs) % 1024 + shift)
            lens.append(n)
    offs, lens = np.array(offs, np.int64), np.array(lens, np.int64)
    out = np.zeros((offs.size, 32), np.uint8)
    run(_p(data), _p(offs), _p(lens), _p(out), ctypes.c_longlong(offs.size))
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
    for n, leaf, fanout, root in DOC_VECTORS:
        data = doc_payload(n)
        size = data.size
        data = np.concatenate((data, np.zeros(16, np.uint8)))
        assert _run_fused_on_host(cuda_source_on_host, data, [0], [size], leaf, fanout) == [bytes.fromhex(root)]


# -- The CuPy fast path's host side, with the launch run by the CUDA source compiled for the host ----
# CPU tensors stand in for device 0; the launcher's CuPy function is replaced by a call into the host
# build of csrc/sha256.cu with exactly the argument tuple the launcher built (pointers, counts, scratch,
# counters).


@pytest.fixture
def host_launcher(monkeypatch, cuda_source_on_host):
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

    def bind(launcher):
        launcher.fn = HostFunction()
        launcher.fn.handle = launcher.handle
        launcher.stream = type("Stream", (), {"ptr": launcher.handle})()
        launcher.getdev = lambda: launcher.index
        launcher.device_ctx = None

    stream = {"handle": 1234}
    monkeypatch.setattr(sha_mod._StreamLauncher, "_bind", bind)
    monkeypatch.setattr(sha_mod, "_stream_handle", lambda index: stream["handle"])
    monkeypatch.setattr(sha_mod, "_resolve", lambda backend, device: "cupy")
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    for name in ("_LAUNCHERS", "_VALIDATED", "_COUNTERS"):
        monkeypatch.setattr(sha_mod, name, {})
    checks = []
    real_messages = sha_mod._messages
    monkeypatch.setattr(sha_mod, "_messages", lambda *a: checks.append(1) or real_messages(*a))
    return launches, checks, stream


def test_fast_path_repeated_calls_launch_only(host_launcher):
    launches, checks, _ = host_launcher
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
    assert len(sha_mod._LAUNCHERS) == 1
    for c in sha_mod._COUNTERS.values():
        assert not c.any()                                      # self-resetting, as on the GPU
    # New data (same size) at the same places: hashed afresh, no stale pointer.
    other = _bytes(81, data.numel())
    assert _rows(tree_digests(other, offs, lens)) == [tree_digest(other.numpy().tobytes()[o:o + n])
                                                      for o, n in zip(offs, lens)]
    assert len(checks) == 2
    # the fused path by name (the perf comparison's entry) checks and gives the same roots
    assert _rows(sha_mod._tree_digests_by_path(data, offs, lens, path="fused")) == want


def test_fast_path_keeps_every_check(host_launcher):
    launches, checks, _ = host_launcher
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


def test_fast_path_new_offsets_reuse_the_shape_and_streams_get_launchers(host_launcher):
    launches, checks, stream = host_launcher
    data = _bytes(83, 200_000)
    raw = data.numpy().tobytes()
    hits = _sha_plans._fused_shape.cache_info().hits
    for o in (0, 1, 17, 4096, 100_000):
        assert _rows(tree_digests(data, [o], [70_000])) == [tree_digest(raw[o:o + 70_000])]
    assert _sha_plans._fused_shape.cache_info().hits >= hits + 4
    stream["handle"] = 5678                                     # another current stream: its own launcher
    assert _rows(tree_digests(data, [3], [70_000])) == [tree_digest(raw[3:70_003])]
    assert set(sha_mod._LAUNCHERS) == {(0, 1234), (0, 5678)} and set(sha_mod._COUNTERS) == set(sha_mod._LAUNCHERS)
    # A bigger tree grows the launcher's scratch; plans prepared before are prepared again, still right.
    big = _bytes(84, 5 << 20)
    assert _rows(tree_digests(big, [0], [5 << 20])) == [tree_digest(big.numpy().tobytes())]
    assert _rows(tree_digests(data, [3], [70_000])) == [tree_digest(raw[3:70_003])]
    for c in sha_mod._COUNTERS.values():
        assert not c.any()


def test_tree_launch_repeats_a_checked_digest_on_its_stream_only(host_launcher):
    """``_tree_launch`` (the route's short path) writes the roots of a call that ``tree_digests``
    made before, with the same values and parameters, on the same stream, into the rows it is given,
    by one launch and no checks (one object or several); anything else launches nothing and says so."""
    launches, checks, stream = host_launcher
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
                 (data, (7,), (70_000,), 4096, 64, 5678),  # another stream: its launcher has not prepared this
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


def test_a_repeated_call_on_a_stream_is_one_launch_into_an_out_it_accepts(host_launcher, monkeypatch):
    """``tree_digests(..., out=, stream=)``: the first call checks and plans, a repeat on that
    stream into ``out`` is one launch (no checks); an ``out`` or ``data`` the launch would write or
    read wrongly (another dtype, shape, a strided view) never takes that launch: the full path
    writes it row by row or refuses it by name."""
    launches, checks, stream = host_launcher
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device=None: handle)  # CPU stand-ins of the stream
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    data = _bytes(86, 300_000)
    raw = data.numpy().tobytes()
    offs, lens = (7, 100_000), (70_000, 200_000)
    want = [tree_digest(raw[o:o + n]) for o, n in zip(offs, lens)]
    out = torch.zeros((2, 32), dtype=torch.uint8)
    assert tree_digests(data, offs, lens, out=out, stream=1234) is out and _rows(out) == want
    n_checks, n_launches = len(checks), len(launches)
    out.zero_()
    assert tree_digests(data, offs, lens, out=out, stream=1234) is out and _rows(out) == want
    assert len(checks) == n_checks and len(launches) == n_launches + 1
    strided = torch.zeros((2, 64), dtype=torch.uint8)[:, ::2]
    assert tree_digests(data, offs, lens, out=strided, stream=1234) is strided
    assert _rows(strided.contiguous()) == want
    for bad in (torch.zeros((2, 32), dtype=torch.int32), torch.zeros((2, 16), dtype=torch.uint8),
                torch.zeros((3, 32), dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)):
        before = bad.clone()
        with pytest.raises(LayoutError, match="out"):
            tree_digests(data, offs, lens, out=bad, stream=1234)
        assert torch.equal(bad, before)
    wide = torch.zeros(300_000, dtype=torch.int64)  # as many elements as the plan's bytes: still not uint8
    with pytest.raises(LayoutError, match="data: expected uint8"):
        tree_digests(wide, offs, lens, out=out, stream=1234)
    assert not sha_mod._tree_launch(data[::2].contiguous(), offs, lens, 4096, 64, 1234, out)  # too short
    assert not sha_mod._tree_launch(torch.zeros(600_000, dtype=torch.uint8)[::2], offs, lens, 4096, 64, 1234, out)


# -- GPU: the one-launch tree (fused) against hashlib's reference, and against the per-level path ---

def _need_cupy() -> None:
    if not _backend.has_cupy():
        pytest.skip("needs cupy with a CUDA device (not installed here)")


def _reference_roots(raw: bytes, offs, lens, leaf: int = 4096, fanout: int = 64) -> list[bytes]:
    return [tree_digest(raw[o:o + n], leaf_size=leaf, fanout=fanout) for o, n in zip(offs, lens)]


PATHS = ["fused", "levels"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_gpu_tree_paths_doc_vectors(path):
    _need_cupy()
    for n, leaf, fanout, root in DOC_VECTORS:
        host = doc_payload(n)
        got = sha_mod._tree_digests_by_path(torch.from_numpy(host).cuda(), [0], [host.size], path=path,
                                           leaf_size=leaf, fanout=fanout)
        assert _rows(got) == [bytes.fromhex(root)], (n, leaf, fanout)
    # All vectors of one shape in one call, back to back in one buffer.
    vecs = [(n, root) for n, leaf, fanout, root in DOC_VECTORS if (leaf, fanout) == (4096, 64)]
    parts = [doc_payload(n) for n, _ in vecs]
    lens = [p.size for p in parts]
    offs = np.cumsum([0] + lens[:-1]).astype(np.int64)
    got = sha_mod._tree_digests_by_path(torch.from_numpy(np.concatenate(parts)).cuda(), offs, lens, path=path)
    assert _rows(got) == [bytes.fromhex(r) for _, r in vecs]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shift", [0, 1, 3, 4, 8, 13])
def test_gpu_tree_paths_random_lengths_many_objects(path, shift):
    """300 objects of random lengths 0 .. 3*4096+17 (one to four leaves), every start alignment."""
    _need_cupy()
    rng = np.random.default_rng(30 + shift)
    lens = rng.integers(0, 3 * 4096 + 18, 300).tolist() + [0, 0, 1, 63, 64, 4095, 4096, 4097, 3 * 4096 + 17]
    gaps = rng.integers(0, 40, len(lens))
    offs = np.cumsum([shift] + [n + int(g) for n, g in zip(lens[:-1], gaps[:-1])]).astype(np.int64)
    host = _bytes(31 + shift, int(offs[-1]) + lens[-1] + 16)
    _poison_cuda_allocator(64 << 20)
    got = sha_mod._tree_digests_by_path(host.cuda(), offs, lens, path=path)
    assert _rows(got) == _reference_roots(host.numpy().tobytes(), offs.tolist(), lens)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shift", [0, 5, 16])
def test_gpu_tree_paths_tree_shapes(path, shift):
    """1, 64, 65 and 4097 leaves (one, two, three and three levels), partial last leaves, and a
    leaf count that is no multiple of the fanout, in one call with small objects in between."""
    _need_cupy()
    leaf = 4096
    lens = [leaf, 64 * leaf, 64 * leaf - 1, 65 * leaf, 65 * leaf - 7, 4097 * leaf, 4097 * leaf - 4095,
            4096 * leaf + 1, 0, 17, 3 * 64 * leaf + 5 * leaf + 3]
    offs = np.cumsum([shift] + [n + 48 + shift for n in lens[:-1]]).astype(np.int64)
    host = _bytes(40 + shift, int(offs[-1]) + lens[-1] + 16)
    got = sha_mod._tree_digests_by_path(host.cuda(), offs, lens, path=path)
    assert _rows(got) == _reference_roots(host.numpy().tobytes(), offs.tolist(), lens)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("leaf,fanout", TREE_SHAPES + [pytest.param(64, 64, id="leaf64-fan64"),
                                                       pytest.param(4096, 2, id="leaf4096-fan2")])
def test_gpu_tree_paths_other_parameters(path, leaf, fanout):
    _need_cupy()
    lens = _tree_lengths(leaf, fanout)
    offs = np.cumsum([7] + [n + 9 for n in lens[:-1]]).astype(np.int64)
    host = _bytes(50, int(offs[-1]) + lens[-1] + 16)
    got = sha_mod._tree_digests_by_path(host.cuda(), offs, lens, path=path, leaf_size=leaf, fanout=fanout)
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
            results.append(sha_mod._tree_digests_by_path(data, offs, lens, path="fused"))
    torch.cuda.synchronize()
    for (offs, lens), got in zip(calls, results):
        assert _rows(got) == _reference_roots(raw, offs.tolist(), lens.tolist())
    for c in sha_mod._COUNTERS.values():
        assert int(torch.count_nonzero(c)) == 0


@pytest.fixture
def paths_taken(monkeypatch):
    """The CuPy tree paths each call took: "fused" (one launch) or "levels" (a launch per level)."""
    taken = []
    real_fused, real_levels = sha_mod._StreamLauncher.run, sha_mod._cupy_tree

    def fused(self, *args, **kwargs):
        taken.append("fused")
        return real_fused(self, *args, **kwargs)

    def levels(*args, **kwargs):
        taken.append("levels")
        return real_levels(*args, **kwargs)

    monkeypatch.setattr(sha_mod._StreamLauncher, "run", fused)
    monkeypatch.setattr(sha_mod, "_cupy_tree", levels)
    return taken


@pytest.mark.gpu
def test_gpu_fused_is_the_default_cupy_tree_and_matches_levels_on_large_payload(paths_taken):
    """64 MiB + 12 MiB in one call: tree_digests (fused, one launch: under ``_FUSED_MAX_BYTES``)
    equals the per-level path and the reference."""
    _need_cupy()
    host = _bytes(70, (64 << 20) + (12 << 20) + 3)
    offs, lens = [0, (64 << 20) + 3, (67 << 20) + 3, (70 << 20) + 3, (73 << 20) + 3], [64 << 20] + [3 << 20] * 4
    data = host.cuda()
    fused = _rows(tree_digests(data, offs, lens, backend="cupy"))
    assert paths_taken == ["fused"]
    levels = _rows(sha_mod._tree_digests_by_path(data, offs, lens, path="levels"))
    assert paths_taken == ["fused", "levels"]
    assert fused == levels == _reference_roots(host.numpy().tobytes(), offs, lens)


@pytest.mark.gpu
def test_gpu_batches_from_fused_max_bytes_up_take_the_per_level_path(monkeypatch, paths_taken):
    """At and above ``_FUSED_MAX_BYTES`` (the measured crossover) tree_digests launches per level;
    below it, one fused launch; both give the reference's roots, also when repeated."""
    _need_cupy()
    monkeypatch.setattr(sha_mod, "_FUSED_MAX_BYTES", 1 << 20)
    host = _bytes(71, 3 << 20)
    raw = host.numpy().tobytes()
    data = host.cuda()
    for offs, lens, path in (([0, 1 << 20], [1 << 20, 4096], "levels"), ([0], [(1 << 20) - 1], "fused"),
                             ([5, 4096], [(1 << 20) - 5, 5], "levels")):  # exactly the threshold
        paths_taken.clear()
        for _ in range(2):
            assert _rows(tree_digests(data, offs, lens, backend="cupy")) == _reference_roots(raw, offs, lens)
        assert paths_taken == [path, path], (offs, lens)


@pytest.mark.gpu
def test_the_fused_kernel_is_launched_by_the_driver_else_by_cupy_with_the_same_roots(monkeypatch):
    """The fused tree kernel launched through cuLaunchKernel (kmesh_gpu.cuda) gives the roots of
    CuPy's own launch, which serves where the driver refuses (fault injection), and the reference's."""
    _need_cupy()
    gen = torch.Generator().manual_seed(4)
    host = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=gen)
    data = host.cuda()
    offsets, lengths = [0, 1 << 20, (1 << 20) + 4096], [1 << 20, 4096, (2 << 20) - 4096]
    accepted, real = [], cuda.launch

    def counted(*args):
        ok = real(*args)
        accepted.append(ok)
        return ok

    monkeypatch.setattr(cuda, "launch", counted)
    roots = {}
    for refused in (False, True):
        if refused:
            monkeypatch.setattr(cuda, "_DRIVER", [(None, None, None, None)])
        accepted.clear()
        roots[refused] = tree_digests(data, offsets, lengths, backend="cupy").cpu()
        assert accepted == [not refused]
    assert torch.equal(roots[True], roots[False])
    for i, (o, n) in enumerate(zip(offsets, lengths)):
        assert bytes(roots[True][i].tolist()) == tree_digest(host[o:o + n].numpy().tobytes())
