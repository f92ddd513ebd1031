"""Regressions of the integrity digests and the segment write side found by an audit (each failed
before its fix): ``get(..., model_fingerprint=None)`` returning a segment unchecked, object arrays
hashed as their pointers, unconvertible or big-endian token ids and positions, an architecture name
pyarrow cannot store, fingerprint and rope descriptions of the wrong kind or colliding keys, index
lists outside int64, empty N-d arrays and conjugate views, payloads check_payload could not take,
too-deep ropes, chunk sizes and thread counts of the wrong type: typed errors or exact results.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

import kmesh_gpu
from kmesh_host import (
    IntegrityError,
    KmeshError,
    LayoutError,
    ModelFingerprint,
    SegmentStore,
    sha256,
    tree_digest,
)
from kmesh_host.integrity import object_digests
from kmesh_host.segment import check_fingerprint, check_payload, decode_header, encode_segment, read_schema_head


def _fp(arch="Qwen2ForCausalLM", rope=None) -> ModelFingerprint:
    return ModelFingerprint(arch, 1, 1, 4, "float32", {"base": 1e6} if rope is None else rope)


def _kv() -> torch.Tensor:
    return torch.randn(2, 1, 3, 1, 4, generator=torch.Generator().manual_seed(0))


def _files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def _header(fp):
    key, data = encode_segment(_kv(), [1, 2, 3], [0, 1, 2], model_fingerprint=fp, chunk_size=512)
    off, padded = read_schema_head(memoryview(data)[:65536], "t", data.size)
    return decode_header(data, "t", payload_offset=off, padded_length=padded), bytes(memoryview(data)[off:off + padded])


# ---- B1: a None fingerprint skips the model check (segment.py:559) -------------------------------

def test_check_fingerprint_refuses_none_on_a_fresh_header():
    h, _ = _header(_fp())
    with pytest.raises(LayoutError, match="model_fingerprint"):
        check_fingerprint(h, None)


def test_store_get_refuses_a_missing_fingerprint(tmp_path):
    st = SegmentStore(tmp_path)
    key = st.put(_kv(), [1, 2, 3], [0, 1, 2], model_fingerprint=_fp())
    with pytest.raises(LayoutError, match="model_fingerprint"):
        st.get(key, model_fingerprint=None)


# ---- B2: object-dtype buffers are hashed as PyObject pointers (integrity.py:76-79, sha256.py:84) -

def _equal_object_arrays():
    a = np.array([1.5, "x"], dtype=object)
    b = np.array([float("1.5"), "x"], dtype=object)     # equal content, other float object
    assert (a == b).all()
    return a, b


@pytest.mark.parametrize("fn", [sha256, tree_digest, object_digests], ids=lambda f: f.__name__)
def test_host_digests_refuse_object_arrays(fn):
    a, _ = _equal_object_arrays()
    with pytest.raises(LayoutError):
        fn(a)
    with pytest.raises(LayoutError):
        fn(memoryview(a))


def test_gpu_api_refuses_a_memoryview_of_an_object_array():
    a, _ = _equal_object_arrays()
    with pytest.raises(LayoutError):
        kmesh_gpu.sha256_batched(memoryview(a), [0], [16], backend="host")
    with pytest.raises(LayoutError):
        kmesh_gpu.tree_digests(memoryview(a), [0], [16], backend="host")


# ---- B3: token_ids / positions of unconvertible kinds raise untyped errors (segment.py:294) -------

@pytest.mark.parametrize("which", ["token_ids", "positions"])
@pytest.mark.parametrize("bad", [
    [2 ** 63, 1, 2], [-(2 ** 64), 1, 2], "abc", None, {"a": 1}, {1, 2, 3}, np.array([1, 2, 3], dtype=object),
    b"abc",
], ids=repr)
def test_unconvertible_token_ids_or_positions_are_layout_errors(which, bad, tmp_path):
    st = SegmentStore(tmp_path)
    args = {"token_ids": [1, 2, 3], "positions": [0, 1, 2]}
    args[which] = bad
    with pytest.raises(LayoutError, match=which):
        st.put(_kv(), args["token_ids"], args["positions"], model_fingerprint=_fp())
    assert _files(tmp_path) == []


def test_big_endian_int64_ids_are_accepted_exactly_or_refused_typed(tmp_path):
    st = SegmentStore(tmp_path)
    tok = np.array([7, -1, 2 ** 40], dtype=">i8")
    try:
        key = st.put(_kv(), tok, [0, 1, 2], model_fingerprint=_fp())
    except LayoutError:
        return
    assert st.get(key, model_fingerprint=_fp()).token_ids.tolist() == [7, -1, 2 ** 40]


# ---- B4: an architecture that is not UTF-8 encodable is accepted, then put fails untyped ----------

def test_lone_surrogate_architecture_is_refused_typed(tmp_path):
    st = SegmentStore(tmp_path)
    with pytest.raises(LayoutError, match="architecture"):
        fp = _fp(arch="Qwen2\ud800")
        st.put(_kv(), [1, 2, 3], [0, 1, 2], model_fingerprint=fp)
    assert _files(tmp_path) == []


# ---- B5: ModelFingerprint.from_dict: untyped errors and silently replaced rope (segment.py:169-174)

@pytest.mark.parametrize("d", [None, ["architecture"], "abc", 5], ids=repr)
def test_from_dict_of_a_non_mapping_is_a_layout_error(d):
    with pytest.raises(LayoutError, match="model_fingerprint"):
        ModelFingerprint.from_dict(d)


@pytest.mark.parametrize("rope", ["", 0, [], False], ids=repr)
def test_from_dict_refuses_a_rope_the_constructor_refuses(rope):
    base = {"architecture": "A", "num_layers": 1, "num_kv_heads": 1, "head_size": 4, "dtype": "float32"}
    with pytest.raises(LayoutError, match="rope"):
        ModelFingerprint(**base, rope=rope)
    with pytest.raises(LayoutError, match="rope"):
        ModelFingerprint.from_dict({**base, "rope": rope})


# ---- B6: rope keys that collide as strings silently lose a value (segment.py:94) -----------------

def test_rope_keys_colliding_as_strings_are_refused():
    a = {1: "int one", "1": "str one"}
    b = {"1": "str one", 1: "int one"}
    assert a == b                                          # the same mapping to Python
    with pytest.raises(LayoutError, match="rope"):
        _fp(rope=a)
    with pytest.raises(LayoutError, match="rope"):
        _fp(rope={"scaling": b})


# ---- B7: kmesh_gpu index lists with ints beyond int64 raise OverflowError (sha256.py:110) ---------

@pytest.mark.parametrize("offs,lens", [([2 ** 63], [0]), ([0], [2 ** 64]), ([-(2 ** 63) - 1], [0])])
@pytest.mark.parametrize("fn", [kmesh_gpu.sha256_batched, kmesh_gpu.tree_digests], ids=lambda f: f.__name__)
def test_out_of_range_index_lists_are_layout_errors(fn, offs, lens):
    with pytest.raises(LayoutError):
        fn(b"abcd", offs, lens, backend="host")


# ---- B8: kmesh_host._byte_view: empty N-d arrays refused, untyped errors (integrity.py:68-82) -----

@pytest.mark.parametrize("empty", [np.empty((0, 3)), np.zeros((4, 0), np.uint8), memoryview(np.empty((0, 3)))],
                         ids=["np(0,3)", "np(4,0)", "memoryview(0,3)"])
def test_empty_multidimensional_buffers_hash_as_no_bytes(empty):
    assert sha256(torch.empty(0, 3)) == hashlib.sha256(b"").digest()      # torch's equivalent: accepted
    assert sha256(empty) == hashlib.sha256(b"").digest()
    assert tree_digest(empty) == tree_digest(b"")


@pytest.mark.parametrize("arr", [np.array(["2020-01-01"], dtype="datetime64[D]"),
                                 np.array([5], dtype="timedelta64[s]")], ids=["datetime64", "timedelta64"])
def test_numpy_arrays_without_a_buffer_export_are_hashed_as_their_bytes_or_refused_typed(arr):
    for fn, want in ((sha256, hashlib.sha256(arr.tobytes()).digest()), (tree_digest, tree_digest(arr.tobytes()))):
        try:
            got = fn(arr)
        except LayoutError:
            continue
        assert got == want


@pytest.mark.parametrize("bad", [torch.tensor([1 + 2j, 3 - 4j]).conj(), torch._neg_view(torch.tensor([1.0, 2.0]))],
                         ids=["conj-view", "neg-view"])
def test_conjugate_and_negative_views_are_layout_errors(bad):
    with pytest.raises(LayoutError):
        sha256(bad)
    with pytest.raises(LayoutError):
        tree_digest(bad)


# ---- B9: check_payload raises untyped TypeError for tensors and non-buffers (segment.py:571) ------

def test_check_payload_takes_a_cpu_tensor_and_refuses_others_typed():
    h, raw = _header(_fp())
    check_payload(h, torch.frombuffer(bytearray(raw), dtype=torch.uint8), sha=True, tree=True)
    bad = bytearray(raw)
    bad[3] ^= 1
    with pytest.raises(IntegrityError):
        check_payload(h, torch.frombuffer(bad, dtype=torch.uint8))
    for other in (None, "x" * len(raw), np.frombuffer(raw * 2, np.uint8)[::2]):
        with pytest.raises(LayoutError):
            check_payload(h, other)


# ---- B10: a deeply nested rope raises RecursionError (segment.py:91-108) --------------------------

def test_too_deep_rope_is_a_layout_error():
    rope: dict = {}
    for _ in range(5000):
        rope = {"a": rope}
    with pytest.raises(LayoutError, match="rope"):
        _fp(rope=rope)


# ---- B11: chunk_size of the wrong type raises TypeError on every put (segment.py:341) -------------

@pytest.mark.parametrize("chunk", [4096.0, None, "4096"], ids=repr)
def test_chunk_size_of_the_wrong_type_is_a_layout_error(chunk, tmp_path):
    with pytest.raises(LayoutError, match="chunk_size"):
        encode_segment(_kv(), [1, 2, 3], [0, 1, 2], model_fingerprint=_fp(), chunk_size=chunk)
    with pytest.raises(KmeshError, match="chunk_size"):
        st = SegmentStore(tmp_path, chunk_size=chunk)
        st.put(_kv(), [1, 2, 3], [0, 1, 2], model_fingerprint=_fp())
    assert _files(tmp_path) == []


# ---- B12: tree_digest(threads=...) of the wrong type: works or fails by payload size --------------

@pytest.mark.parametrize("threads", [2.5, "2", True], ids=repr)
@pytest.mark.parametrize("n", [64 * 10, 64 * 10_000])
def test_threads_must_be_an_int(threads, n):
    with pytest.raises(LayoutError, match="threads"):
        tree_digest(bytes(n), leaf_size=64, threads=threads)
