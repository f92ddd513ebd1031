"""Adversarial checks of the integrity digests and of the segment write side, against independent
references: hashlib, and a tree digest written here from the definition (docs/tree-sha256.md).

Covers ``kmesh_host.sha256`` / ``tree_digest`` (native and hashlib piece hashers, threads),
``kmesh_gpu.sha256_batched`` / ``tree_digests`` on the CPU (host, and warp where installed),
``encode_segment`` / ``SegmentStore.put`` input validation, round trips of every segment dtype,
fingerprints with odd values, and the derived key (stable across processes, bound to every field).
"""

from __future__ import annotations

import array
import hashlib
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import kmesh_gpu
from kmesh_gpu import _backend
from kmesh_host import (
    FingerprintMismatch,
    IntegrityError,
    KmeshError,
    LayoutError,
    ModelFingerprint,
    SegmentStore,
    sha256,
    tree_digest,
)
from kmesh_host import integrity
from kmesh_host.segment import (
    SEGMENT_DTYPES,
    check_fingerprint,
    check_payload,
    decode_header,
    encode_segment,
    payload_bytes,
    read_schema_head,
)

# ------------------------------------------------------------------------------------ references


def _h(b) -> bytes:
    return hashlib.sha256(b).digest()


def ref_tree(payload: bytes, leaf: int = 4096, fanout: int = 64) -> bytes:
    """kmesh-tree-sha256/v1 written from the definition, independent of the code under test."""
    n = max(1, -(-len(payload) // leaf))
    level = [_h(payload[i * leaf:(i + 1) * leaf]) for i in range(n)]
    while len(level) > 1:
        level = [_h(b"".join(level[i:i + fanout])) for i in range(0, len(level), fanout)]
    head = b"kmesh-tree-sha256/v1\x00" + struct.pack("<QII", len(payload), leaf, fanout)
    assert len(head) + 32 == 69
    return _h(head + level[0])


_RNG = np.random.default_rng(20260101)
BUF = _RNG.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()


def test_reference_matches_the_published_vectors():
    """The reference here is itself pinned to docs/tree-sha256.md before it judges anything."""
    pat = lambda n: bytes(i % 251 for i in range(n))  # noqa: E731
    assert ref_tree(b"").hex() == "f827070984949eaa357cb8a7e4c45ce7259243db2560daf8d3e7e0253d2bedaf"
    assert ref_tree(b"abc", 64, 2).hex() == "7f7a07bd14c3579ae81f636c02c74e51011da0690a77dad47d86c9098328e4bc"
    assert ref_tree(pat(200), 64, 2).hex() == "4af2d850cec5c2e4c6e43d26b02e1ab1d44cf4c4eaecdd235f4fd81726820765"
    assert ref_tree(pat(262145)).hex() == "800b9993b578bc6dbebf18a50347c1ab8d7cd4efc4b16bd74b8dc212729f2039"


# ------------------------------------------------------------------------------------ sha256

SHA_LENGTHS = [0, 1, 3, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 4095, 4096, 4097]


@pytest.mark.parametrize("n", SHA_LENGTHS)
def test_sha256_every_buffer_kind_equals_hashlib(n):
    raw = BUF[:n]
    want = _h(raw)
    kinds = [raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8),
             torch.frombuffer(bytearray(raw), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)]
    for k in kinds:
        assert sha256(k) == want, type(k).__name__
    # a slice at an odd offset of a larger buffer
    assert sha256(memoryview(BUF)[7:7 + n]) == _h(BUF[7:7 + n])
    assert sha256(torch.frombuffer(bytearray(BUF[:n + 9]), dtype=torch.uint8)[9:]) == _h(BUF[9:n + 9])


def test_non_uint8_inputs_are_hashed_as_their_memory_bytes():
    f32 = np.arange(33, dtype=np.float32).reshape(3, 11)
    be = np.arange(17, dtype=">i4")
    rec = np.zeros(5, dtype=[("a", "<i4"), ("b", "u1")])
    rec["a"] = np.arange(5)
    arr = array.array("d", [1.0, -2.5, float("nan")])
    md = memoryview(np.arange(12, dtype=np.float64).reshape(3, 4))      # 2-D 'd' memoryview
    cases = [(f32, f32.tobytes()), (be, be.tobytes()), (rec, rec.tobytes()), (arr, arr.tobytes()),
             (md, md.tobytes()), (np.array(1.5), np.array(1.5).tobytes()), (np.uint16(513), b"\x01\x02")]
    t = torch.randn(4, 6)
    tens = [t, t.to(torch.bfloat16), t.to(torch.float16), t.to(torch.float8_e4m3fn), t > 0,
            torch.tensor(2.5), torch.randn(3, dtype=torch.complex64), t.requires_grad_(True),
            torch.empty_strided((1, 6), (1000, 1)).fill_(3.0),              # size-1 dim, odd stride
            torch.arange(40, dtype=torch.int16)[5:29]]                     # storage offset
    cases += [(x, x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for x in tens]
    for payload, raw in cases:
        assert sha256(payload) == _h(raw)
        assert tree_digest(payload, leaf_size=64, fanout=3) == ref_tree(raw, 64, 3)


@pytest.mark.parametrize("bad", [
    np.arange(10, dtype=np.uint8)[::2], np.arange(10, dtype=np.uint8)[::-1],
    np.asfortranarray(np.arange(12, dtype=np.uint8).reshape(3, 4)), memoryview(bytes(10))[::2],
    torch.arange(12.0).reshape(3, 4).t(), torch.zeros(1).expand(4), torch.eye(3).to_sparse(),
    torch.zeros(3, device="meta"), "text", None, 5, [1, 2, 3], 1.5,
], ids=lambda x: type(x).__name__)
def test_non_contiguous_and_non_buffers_are_refused_typed(bad):
    for fn in (sha256, tree_digest, integrity.object_digests):
        with pytest.raises(LayoutError):
            fn(bad)


# ------------------------------------------------------------------------------------ tree digest

def _sizes(leaf: int, fanout: int) -> list[int]:
    ks = {0, 1, 2, 3, fanout - 1, fanout, fanout + 1, fanout * fanout, fanout * fanout + 1,
          integrity._NATIVE_MIN_PIECES - 1, integrity._NATIVE_MIN_PIECES,
          integrity._PARALLEL_MIN_PIECES - 1, integrity._PARALLEL_MIN_PIECES,
          integrity._PARALLEL_MIN_PIECES + 1}
    return sorted({k * leaf + d for k in ks for d in (-1, 0, 1) if 0 <= k * leaf + d <= len(BUF)})


@pytest.mark.parametrize("leaf,fanout", [(64, 2), (64, 3), (192, 5), (128, 64), (4096, 64)])
@pytest.mark.parametrize("native", [True, False], ids=["native", "hashlib"])
def test_tree_digest_boundaries_equal_the_definition(leaf, fanout, native, monkeypatch):
    if not native:
        monkeypatch.setattr(integrity, "_native_piece_hasher", lambda: None)
    for n in _sizes(leaf, fanout):
        want = ref_tree(BUF[:n], leaf, fanout)
        assert tree_digest(BUF[:n], leaf_size=leaf, fanout=fanout, threads=1) == want, n
        assert tree_digest(np.frombuffer(BUF, np.uint8)[:n], leaf_size=leaf, fanout=fanout, threads=2) == want, n


def test_native_piece_hasher_is_used_here_and_agrees_on_short_last_pieces():
    """Where Numba and libcrypto exist (this venv) the native loop must give hashlib's digests,
    including a short last piece and a zero-length tail call."""
    native = integrity._native_piece_hasher()
    if native is None:   # the hashlib path is covered by the boundary test above
        assert integrity._level(memoryview(b"x" * 130), 64, 3, None, 1) == b"".join(
            _h(p) for p in (b"x" * 64, b"x" * 64, b"xx"))
        return
    src = np.frombuffer(BUF[:1000], np.uint8)
    out = np.zeros(32 * 4, np.uint8)
    native(src.ctypes.data, src.size, 300, 0, 4, out.ctypes.data)
    assert out.tobytes() == b"".join(_h(BUF[i:min(i + 300, 1000)]) for i in (0, 300, 600, 900))
    native(src.ctypes.data, src.size, 300, 2, 2, out.ctypes.data)   # empty range writes nothing
    assert out.tobytes()[64:96] == _h(BUF[600:900])


def test_tree_root_commits_to_length_and_parameters():
    roots = {tree_digest(BUF[:n], leaf_size=leaf, fanout=f) for n in (0, 64, 65) for leaf in (64, 128)
             for f in (2, 3)}
    assert len(roots) == 12
    # trailing zeros are part of the length: never the same root
    assert tree_digest(BUF[:100] + bytes(28), leaf_size=64) != tree_digest(BUF[:100], leaf_size=64)
    # a leaf digest or an inner node is never a root
    two = BUF[:128]
    assert tree_digest(two, leaf_size=64, fanout=2) not in (_h(two[:64]), _h(_h(two[:64]) + _h(two[64:])))


@pytest.mark.parametrize("kw", [
    dict(leaf_size=0), dict(leaf_size=-64), dict(leaf_size=63), dict(leaf_size=65), dict(leaf_size=96),
    dict(leaf_size=(1 << 30) + 64), dict(leaf_size=1 << 31), dict(leaf_size=1 << 64),
    dict(leaf_size=np.int64(4096)), dict(leaf_size=4096.0), dict(leaf_size=True), dict(leaf_size=None),
    dict(leaf_size="4096"), dict(fanout=0), dict(fanout=1), dict(fanout=-2), dict(fanout=(1 << 24) + 1),
    dict(fanout=np.int32(4)), dict(fanout=2.0), dict(fanout=False), dict(fanout=1 << 70),
], ids=lambda d: f"{next(iter(d))}={d[next(iter(d))]!r}")
def test_invalid_tree_parameters_are_refused_typed_everywhere(kw):
    calls = [lambda: tree_digest(b"abc", **kw), lambda: integrity.object_digests(b"abc", **kw),
             lambda: integrity.check_tree_params(kw.get("leaf_size", 4096), kw.get("fanout", 64)),
             lambda: kmesh_gpu.tree_digests(b"abc", [0], [3], backend="host", **kw)]
    for call in calls:
        with pytest.raises(IntegrityError, match=next(iter(kw))):
            call()
    assert issubclass(IntegrityError, KmeshError)


def test_extreme_valid_parameters():
    payload = BUF[:5000]
    assert tree_digest(payload, leaf_size=1 << 30, fanout=1 << 24) == ref_tree(payload, 1 << 30, 1 << 24)
    assert tree_digest(payload, leaf_size=64, fanout=1 << 24) == ref_tree(payload, 64, 1 << 24)
    assert tree_digest(b"", leaf_size=64, fanout=2) == ref_tree(b"", 64, 2)


@pytest.mark.parametrize("threads", [0, -1])
def test_thread_count_below_one_is_refused(threads):
    with pytest.raises(LayoutError, match="threads"):
        tree_digest(b"abc", threads=threads)


def test_threads_never_change_the_root():
    payload = BUF[:300 * 64 + 17]
    want = ref_tree(payload, 64, 4)
    assert {tree_digest(payload, leaf_size=64, fanout=4, threads=t) for t in (1, 2, 3, 7)} == {want}


# ------------------------------------------------------------------------------------ kmesh_gpu on CPU

CPU_BACKENDS = ["host"] + (["warp"] if _backend.has_warp() else [])


def test_public_gpu_names_exist_and_run_on_cpu():
    assert callable(kmesh_gpu.sha256_batched) and callable(kmesh_gpu.tree_digests)
    got = kmesh_gpu.tree_digests(b"abc", [0], [3])
    assert got.device.type == "cpu" and bytes(got[0].numpy()) == ref_tree(b"abc")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batched_mixed_lengths_duplicates_and_overlaps(backend):
    offs = [0, 5, 0, 100, 3, 3, 3, 1, 0, 17, 999, 12345, 3, 0]
    lens = [0, 1, 55, 56, 63, 64, 65, 4095, 4096, 4097, 70000, 0, 65, len(BUF)]
    got = kmesh_gpu.sha256_batched(BUF, offs, lens, backend=backend)
    assert got.shape == (len(offs), 32) and got.dtype == torch.uint8
    assert [bytes(r) for r in got.numpy()] == [_h(BUF[o:o + m]) for o, m in zip(offs, lens)]
    for leaf, fanout in [(64, 2), (192, 3), (4096, 64)]:
        got = kmesh_gpu.tree_digests(np.frombuffer(BUF, np.uint8), np.array(offs), np.array(lens),
                                     leaf_size=leaf, fanout=fanout, backend=backend)
        assert [bytes(r) for r in got.numpy()] == [ref_tree(BUF[o:o + m], leaf, fanout)
                                                   for o, m in zip(offs, lens)], (leaf, fanout)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batched_zero_items_and_empty_data(backend):
    for data in (b"", BUF[:10], torch.zeros(0, dtype=torch.uint8)):
        assert kmesh_gpu.sha256_batched(data, [], [], backend=backend).shape == (0, 32)
        assert kmesh_gpu.tree_digests(data, np.zeros(0, np.int64), [], backend=backend).shape == (0, 32)
    got = kmesh_gpu.tree_digests(b"", [0, 0, 0], [0, 0, 0], leaf_size=64, fanout=2, backend=backend)
    assert [bytes(r) for r in got.numpy()] == [ref_tree(b"", 64, 2)] * 3


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_verify_tree_roots_catches_one_flipped_bit(backend):
    data = bytearray(BUF[:20000])
    offs, lens = [0, 5000, 5000, 12000], [5000, 7000, 7000, 8000]
    roots = [ref_tree(bytes(data[o:o + m]), 256, 4) for o, m in zip(offs, lens)]
    kmesh_gpu.verify_tree_roots(bytes(data), offs, lens, roots, leaf_size=256, fanout=4, backend=backend)
    data[13000] ^= 0x01
    with pytest.raises(IntegrityError, match="'c'"):
        kmesh_gpu.verify_tree_roots(bytes(data), offs, lens, roots, names=["a", "b", "b2", "c"],
                                    leaf_size=256, fanout=4, backend=backend)


@pytest.mark.parametrize("call", [
    lambda: kmesh_gpu.sha256_batched(b"abcd", np.array([0], np.uint64), np.array([1], np.uint64)),
    lambda: kmesh_gpu.sha256_batched(b"abcd", np.array([0], ">i8"), np.array([1], ">i8")),
    lambda: kmesh_gpu.sha256_batched(b"abcd", [np.int64(0)], [1]),
    lambda: kmesh_gpu.sha256_batched(b"abcd", [False], [True]),
    lambda: kmesh_gpu.sha256_batched(b"abcd", [0.0], [1]),
    lambda: kmesh_gpu.sha256_batched(b"abcd", None, None),
    lambda: kmesh_gpu.sha256_batched(b"abcd", np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64)),
    lambda: kmesh_gpu.sha256_batched(b"abcd", torch.tensor([0], dtype=torch.int32), [1]),
    lambda: kmesh_gpu.sha256_batched(b"abcd", [3], [2]),
    lambda: kmesh_gpu.sha256_batched(b"abcd", [2 ** 62], [2 ** 62]),
    lambda: kmesh_gpu.sha256_batched(b"abcd", list(range(40)), [1] * 39 + [-1]),     # numpy path (> 32)
    lambda: kmesh_gpu.sha256_batched(b"abcd", [0] * 40, [2 ** 63 - 1] * 40),
    lambda: kmesh_gpu.sha256_batched("abcd", [0], [1]),
    lambda: kmesh_gpu.sha256_batched(memoryview(b"abcdef")[::2], [0], [1]),
    lambda: kmesh_gpu.sha256_batched(np.arange(4, dtype=np.int32), [0], [1]),
    lambda: kmesh_gpu.sha256_batched(np.arange(8, dtype=np.uint8)[::2], [0], [1]),
    lambda: kmesh_gpu.tree_digests(torch.zeros(2, 4, dtype=torch.uint8), [0], [1]),
    lambda: kmesh_gpu.tree_digests(np.array([1, 2], dtype=object), [0], [1]),
], ids=lambda f: "")
def test_batched_bad_arguments_are_refused_typed(call):
    with pytest.raises(LayoutError):
        call()


# ------------------------------------------------------------------------------------ segments

def fp_for(dtype: str, L: int, H: int, D: int, rope=None, arch="Qwen2ForCausalLM") -> ModelFingerprint:
    return ModelFingerprint(arch, L, H, D, dtype, {"base": 1e6, "rotary_dim": D} if rope is None else rope)


def _files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


_SPECIALS = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 65504.0, -1.0, 3.0e38]


def _kv(dtype: torch.dtype, shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype in (torch.uint8, torch.float8_e4m3fn):       # every byte pattern, fp8 NaN (0x7f/0xff) too
        raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        raw[: min(n, 4)] = torch.tensor([0x7F, 0xFF, 0x80, 0x00], dtype=torch.uint8)[: min(n, 4)]
        return raw.view(dtype).reshape(shape)
    x = torch.randn(n, generator=g)
    k = min(n, len(_SPECIALS))
    x[:k] = torch.tensor(_SPECIALS[:k])
    x = x.to(dtype)
    if n > 1:                                             # a NaN with payload bits set
        bits = {torch.float32: (torch.int32, 0x7FC12345), torch.float16: (torch.int16, 0x7E01),
                torch.bfloat16: (torch.int16, 0x7FC1)}[dtype]
        x.view(bits[0])[1] = bits[1]
    return x.reshape(shape)


@pytest.mark.parametrize("dtype", list(SEGMENT_DTYPES))
def test_every_dtype_and_odd_shapes_round_trip_bit_exact(dtype, tmp_path):
    st = SegmentStore(tmp_path, chunk_size=512)
    tdt = SEGMENT_DTYPES[dtype]
    for shape in [(2, 1, 1, 1, 1), (2, 3, 7, 1, 5), (2, 1, 2, 3, 13), (2, 2, 129, 1, 3)]:
        L, T, H, D = shape[1:]
        fp = fp_for(dtype, L, H, D)
        kv = _kv(tdt, shape, seed=T)
        tok = torch.arange(T) * 7 + 1
        pos = torch.arange(T, dtype=torch.int32) + 3
        key = st.put(kv, tok, pos, model_fingerprint=fp)
        seg = st.get(key, model_fingerprint=fp, check="both")
        assert seg.kv.dtype == tdt and tuple(seg.kv.shape) == shape
        assert torch.equal(seg.kv.view(torch.uint8), kv.view(torch.uint8))
        assert seg.token_ids.dtype == torch.int64 and torch.equal(seg.token_ids, tok)
        assert torch.equal(seg.positions, pos.long())
        h = st.verify(key)
        assert h.dense_kv and h.payload_length == kv.numel() * kv.element_size()
        # the stored digests are those of the padded payload
        padded, n = payload_bytes(kv, 512)
        assert h.sha256 == _h(padded.tobytes()) and h.tree_root == ref_tree(padded.tobytes())
        assert n == h.payload_length and not padded[n:].any()


def test_fp8_bytes_under_an_fp8_fingerprint_keep_their_dtype(tmp_path):
    st = SegmentStore(tmp_path)
    fp = fp_for("float8_e4m3fn", 1, 1, 4)
    raw = torch.arange(16, dtype=torch.uint8).reshape(2, 1, 2, 1, 4) * 17
    k_u8 = st.put(raw, [1, 2], [3, 4], model_fingerprint=fp)
    k_f8 = st.put(raw.view(torch.float8_e4m3fn), [1, 2], [3, 4], model_fingerprint=fp)
    assert k_u8 != k_f8
    a, b = st.get(k_u8, model_fingerprint=fp), st.get(k_f8, model_fingerprint=fp)
    assert a.kv.dtype == torch.uint8 and b.kv.dtype == torch.float8_e4m3fn
    assert torch.equal(a.kv, raw) and torch.equal(b.kv.view(torch.uint8), raw)


def test_non_contiguous_kv_is_stored_in_logical_order(tmp_path):
    st = SegmentStore(tmp_path)
    fp = fp_for("float32", 2, 2, 4)
    kv = torch.randn(2, 2, 4, 3, 2).permute(0, 1, 3, 4, 2)   # (2, L=2, T=3, H=2, D=4), not contiguous
    assert not kv.is_contiguous()
    seg = st.get(st.put(kv, [1, 2, 3], [4, 5, 6], model_fingerprint=fp), model_fingerprint=fp)
    assert torch.equal(seg.kv, kv)


_T = 3


@pytest.mark.parametrize("which", ["token_ids", "positions"])
@pytest.mark.parametrize("bad", [
    torch.arange(_T - 1), torch.arange(_T + 1), torch.arange(_T).reshape(1, _T), torch.tensor(3),
    torch.arange(float(_T)), torch.tensor([True, False, True]), torch.arange(_T, dtype=torch.uint8),
    torch.arange(_T, dtype=torch.int16), np.arange(_T, dtype=np.uint64), [1.0, 2.0, 3.0], [1, 2.5, 3],
    [], torch.zeros(0, dtype=torch.int64), np.arange(2 * _T).reshape(2, _T),
], ids=lambda x: f"{type(x).__name__}{list(x.shape) if hasattr(x, 'shape') else [len(x)]}")
def test_bad_token_ids_or_positions_are_refused_and_nothing_is_written(which, bad, tmp_path):
    st = SegmentStore(tmp_path)
    fp = fp_for("float32", 1, 1, 4)
    args = {"token_ids": torch.arange(_T), "positions": torch.arange(_T)}
    args[which] = bad
    with pytest.raises(LayoutError, match=which):
        st.put(torch.randn(2, 1, _T, 1, 4), args["token_ids"], args["positions"], model_fingerprint=fp)
    assert _files(tmp_path) == [] and st.keys() == []


@pytest.mark.parametrize("case", ["ndim", "kv-not-tensor", "empty-T", "dtype", "shape", "fp8-mismatch",
                                  "chunk", "leaf", "fanout", "fingerprint-dict"])
def test_bad_kv_or_parameters_are_refused_and_nothing_is_written(case, tmp_path):
    st = SegmentStore(tmp_path)
    fp = fp_for("bfloat16", 2, 2, 8)
    kv, tok, pos, kw = torch.randn(2, 2, 3, 2, 8).bfloat16(), [1, 2, 3], [0, 1, 2], {}
    if case == "ndim":
        kv = kv[0]
    elif case == "kv-not-tensor":
        kv = kv.float().numpy()
    elif case == "empty-T":
        kv, tok, pos = kv[:, :, :0], [], []
    elif case == "dtype":
        kv = kv.to(torch.float16)
    elif case == "shape":
        kv = torch.randn(2, 2, 3, 8, 2).bfloat16()
    elif case == "fp8-mismatch":
        kv = kv.view(torch.uint8)[..., :8]
    elif case == "chunk":
        kw = dict(chunk_size=1000)
    elif case == "leaf":
        kw = dict(leaf_size=100)
    elif case == "fanout":
        kw = dict(fanout=1)
    elif case == "fingerprint-dict":
        fp = fp.to_dict()
    with pytest.raises(KmeshError):
        if kw:
            encode_segment(kv, tok, pos, model_fingerprint=fp, **kw)
        else:
            st.put(kv, tok, pos, model_fingerprint=fp)
    assert _files(tmp_path) == []


def test_extreme_token_ids_and_positions_round_trip_exactly_or_are_refused(tmp_path):
    """The spec sets no sign on token ids or positions: whatever put accepts, get returns unchanged."""
    st = SegmentStore(tmp_path)
    fp = fp_for("float32", 1, 1, 4)
    ext = [np.array([-(2 ** 63), -1, 2 ** 63 - 1]), np.array([0, 2 ** 31, -(2 ** 31) - 1]),
           np.arange(6)[::2], torch.arange(6)[::2], np.arange(3, dtype=np.int32)]
    for v in ext:
        for which in ("token_ids", "positions"):
            args = {"token_ids": np.arange(3), "positions": np.arange(3)}
            args[which] = v
            try:
                key = st.put(torch.randn(2, 1, 3, 1, 4), args["token_ids"], args["positions"], model_fingerprint=fp)
            except LayoutError:
                continue
            seg = st.get(key, model_fingerprint=fp)
            assert seg.token_ids.tolist() == np.asarray(args["token_ids"]).tolist()
            assert seg.positions.tolist() == np.asarray(args["positions"]).tolist()


ODD_FINGERPRINTS = [
    dict(arch="Qwen2ForCausalLM-日本語-🦙"),
    dict(arch="A\x00B\n\t\"'\\"),
    dict(rope={"a": 2 ** 200, "b": -(2 ** 70), "c": 0}),
    dict(rope={"scaling": {"type": "yarn", "factor": 4.0, "list": [1, [2, {"x": None}], True], "e": {}, "l": []}}),
    dict(rope={"a": 5e-324, "b": 1.7976931348623157e308, "c": -0.0, "d": 0.1, "e": 1e-7}),
    dict(rope={"\ud800": "\udfff", "é": "ü"}),                         # surrogates survive (JSON escapes)
    dict(rope={"a": ["__list__", 1], "__list__": ["__list__"]}),        # the freezing tag as data
    dict(rope={1: "int key", 2.5: "float key", None: "none key"}),     # keys stored as strings
    dict(rope={"dtype": torch.bfloat16, "tuple": (1, 2)}),
    dict(rope={}),
]


@pytest.mark.parametrize("odd", ODD_FINGERPRINTS, ids=lambda d: repr(d)[:40])
def test_odd_fingerprints_round_trip_exactly_through_put_and_get(odd, tmp_path):
    fp = fp_for("float32", 1, 1, 4, rope=odd.get("rope"), arch=odd.get("arch", "Qwen2ForCausalLM"))
    assert ModelFingerprint.from_dict(fp.to_dict()) == fp
    assert ModelFingerprint.from_dict(json.loads(json.dumps(fp.to_dict()))).digest() == fp.digest()
    st = SegmentStore(tmp_path)
    key = st.put(torch.randn(2, 1, 2, 1, 4), [1, 2], [3, 4], model_fingerprint=fp)
    h = SegmentStore(tmp_path).read_header(key)          # a fresh instance: parsed from the file
    assert h.fingerprint == fp and h.fingerprint.to_dict() == fp.to_dict()
    assert h.fingerprint.digest() == fp.digest()
    assert st.get(key, model_fingerprint=fp).fingerprint == fp


@pytest.mark.parametrize("rope", [
    {"a": float("nan")}, {"a": [1, {"b": float("inf")}]}, {"a": -float("inf")}, {"a": b"bytes"},
    {"a": object()}, {"a": np.int64(1)}, {"a": {1, 2}}, [("base", 1.0)], "base=1", 5,
], ids=repr)
def test_unrepresentable_rope_values_are_refused_typed(rope):
    with pytest.raises(LayoutError, match="rope"):
        ModelFingerprint("A", 1, 1, 4, "float32", rope)


@pytest.mark.parametrize("kw", [
    dict(architecture=""), dict(architecture=5), dict(num_layers=0), dict(num_layers=-1),
    dict(num_layers=2.0), dict(num_layers="2"), dict(num_kv_heads=True), dict(head_size=None),
    dict(dtype="float64"), dict(dtype=torch.float8_e5m2), dict(dtype=None), dict(dtype=["float32"]),
], ids=lambda d: repr(d)[:40])
def test_bad_fingerprint_fields_are_refused_typed(kw):
    args = dict(architecture="A", num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", rope={})
    args.update(kw)
    with pytest.raises(LayoutError):
        ModelFingerprint(**args)
    with pytest.raises(LayoutError):
        ModelFingerprint.from_dict(args)


def test_from_dict_missing_fields_are_refused_typed():
    full = fp_for("float32", 1, 1, 4).to_dict()
    for k in ("architecture", "num_layers", "num_kv_heads", "head_size", "dtype"):
        with pytest.raises(LayoutError, match=k):
            ModelFingerprint.from_dict({f: v for f, v in full.items() if f != k})
    assert ModelFingerprint.from_dict({f: v for f, v in full.items() if f != "rope"}).rope_dict() == {}


# ------------------------------------------------------------------------------------ keys

_KEY_SCRIPT = r"""
import json, sys, torch
from kmesh_host import ModelFingerprint
from kmesh_host.segment import encode_segment
fp = ModelFingerprint("Qwen2ForCausalLM-é", 2, 1, 4, "bfloat16",
                      {"z": 1, "a": {"y": [1.5, None, True], "b": 2 ** 80}, 3: "x"})
kv = (torch.arange(2 * 2 * 3 * 1 * 4, dtype=torch.float32) * 0.25 - 3).reshape(2, 2, 3, 1, 4).bfloat16()
OUT = json.dumps([encode_segment(kv, [5, 6, 7], [10, 11, 12], model_fingerprint=fp)[0],
                  encode_segment(kv, [5, 6, 7], [10, 11, 12], model_fingerprint=fp, chunk_size=512,
                                 leaf_size=128, fanout=3)[0], fp.digest()])
print(OUT)
"""


def test_key_is_stable_across_processes_and_hash_seeds():
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", _KEY_SCRIPT], capture_output=True, text=True, env=env,
                           timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    here = {"print": lambda *a: None}                     # the same script in this process
    exec(compile(_KEY_SCRIPT, "<key>", "exec"), here)
    assert outs[0] == outs[1] == json.loads(here["OUT"])
    assert len(set(outs[0])) == 3 and all(len(k) == 64 for k in outs[0])


def test_key_changes_when_any_field_changes():
    base_fp = fp_for("float32", 2, 1, 4)
    kv = torch.randn(2, 2, 3, 1, 4, generator=torch.Generator().manual_seed(3))
    tok, pos = [5, 6, 7], [10, 11, 12]

    def key(kv=kv, tok=tok, pos=pos, fp=base_fp, **kw):
        return encode_segment(kv, tok, pos, model_fingerprint=fp, **kw)[0]

    flipped = kv.clone()
    flipped.view(torch.int32).reshape(-1)[-1] ^= 1                      # one bit of the last value
    reshaped_fp = fp_for("float32", 2, 4, 1)
    variants = {
        "base": key(),
        "payload bit": key(kv=flipped),
        "token id": key(tok=[5, 6, 8]),
        "token order": key(tok=[6, 5, 7]),
        "position": key(pos=[10, 11, 13]),
        "tokens<->positions": key(tok=pos, pos=tok),
        "architecture": key(fp=fp_for("float32", 2, 1, 4, arch="Qwen2ForCausalLX")),
        "rope value": key(fp=fp_for("float32", 2, 1, 4, rope={"base": 1e6, "rotary_dim": 3})),
        "rope extra key": key(fp=fp_for("float32", 2, 1, 4, rope={"base": 1e6, "rotary_dim": 4, "x": None})),
        "rope int vs float": key(fp=fp_for("float32", 2, 1, 4, rope={"base": 1000000, "rotary_dim": 4})),
        "same bytes, other shape": key(kv=kv.reshape(2, 2, 3, 4, 1), fp=reshaped_fp),
        "chunk_size": key(chunk_size=512),
        "leaf_size": key(leaf_size=64),
        "fanout": key(fanout=2),
    }
    assert len(set(variants.values())) == len(variants), variants
    # what is not content does not change it
    assert key(tok=torch.tensor(tok, dtype=torch.int32), pos=np.array(pos)) == variants["base"]
    assert key(kv=kv.clone()) == key(kv=kv.permute(0, 1, 2, 4, 3).contiguous().permute(0, 1, 2, 4, 3)) \
        == variants["base"]
    assert key(fp=ModelFingerprint.from_dict(base_fp.to_dict())) == variants["base"]


def test_same_content_same_file_and_one_write(tmp_path):
    st = SegmentStore(tmp_path)
    fp = fp_for("bfloat16", 1, 1, 8)
    kv = torch.randn(2, 1, 4, 1, 8).bfloat16()
    k1 = st.put(kv, [1, 2, 3, 4], [0, 1, 2, 3], model_fingerprint=fp)
    k2 = SegmentStore(tmp_path).put(kv.clone(), np.arange(1, 5), torch.arange(4, dtype=torch.int32),
                                    model_fingerprint=fp)
    assert k1 == k2 and len(_files(tmp_path)) == 1 and st.stats["writes"] == 1


# ------------------------------------------------------------------------------------ checks on read

def _header(kv, fp, **kw):
    key, data = encode_segment(kv, list(range(kv.shape[2])), list(range(kv.shape[2])), model_fingerprint=fp, **kw)
    off, padded = read_schema_head(memoryview(data)[:65536], "t", data.size)
    h = decode_header(data, "t", payload_offset=off, padded_length=padded)
    assert h.key == key
    return h, bytes(memoryview(data)[off:off + padded])


def test_check_payload_accepts_the_bytes_and_refuses_any_change():
    h, raw = _header(torch.randn(2, 1, 3, 1, 4), fp_for("float32", 1, 1, 4), chunk_size=512, leaf_size=64, fanout=2)
    for ok in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8), np.frombuffer(raw, np.float32)):
        check_payload(h, ok, sha=True, tree=True)
    bad = [raw[:-1], raw + b"\x00", raw[:7] + bytes([raw[7] ^ 0x80]) + raw[8:], raw[:-1] + b"\x01"]
    for b in bad:
        with pytest.raises(IntegrityError, match=h.key):
            check_payload(h, b)
        with pytest.raises(IntegrityError, match=h.key):
            check_payload(h, b, sha=False, tree=True)


def test_check_fingerprint_refuses_every_other_model_and_non_fingerprints():
    fp = fp_for("bfloat16", 1, 2, 4)
    h, _ = _header(torch.randn(2, 1, 3, 2, 4).bfloat16(), fp)
    others = [fp_for("bfloat16", 1, 2, 4, arch="Other"), fp_for("float16", 1, 2, 4),
              fp_for("bfloat16", 2, 2, 4), fp_for("bfloat16", 1, 1, 4), fp_for("bfloat16", 1, 2, 8),
              fp_for("bfloat16", 1, 2, 4, rope={"base": 1e6, "rotary_dim": 4, "scaling": None})]
    for other in others:
        with pytest.raises(FingerprintMismatch, match=h.key):
            check_fingerprint(h, other)
    check_fingerprint(h, ModelFingerprint.from_dict(fp.to_dict()))
    for bad in (fp.to_dict(), "fp", 0):
        with pytest.raises(LayoutError):
            check_fingerprint(h, bad)
    with pytest.raises(FingerprintMismatch):            # after a pass, another model still fails
        check_fingerprint(h, others[0])
