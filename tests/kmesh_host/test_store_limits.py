"""Segments past 256 MiB up to the format's limit, and files of format version 1 (issue "cache
service under hostile and clumsy clients", item 7).

Version 1 typed the payload ``fixed_size_binary(padded length)``, which Arrow's IPC reader refuses
from 256 MiB on, so put() of a 256 MiB segment raised ArrowInvalid although the format's stated
limit is 2 GiB - 4 KiB (MAX_PAYLOAD). Version 2 stores the payload as one large_binary value: the
same single, 4096-aligned byte range of the file, which the host tier, O_DIRECT / cuFile readers and
GPU routes read by offset unchanged. Version 1 files (put() wrote them until now) still read, under
the same key.

Big tensors are zeros with a few marked bytes (a misplaced or shifted byte shows); the one at the
limit is built on never-touched zero pages and read back from a sparse copy of its file.
"""

from __future__ import annotations

import base64
import os
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from kmesh_host import (
    HostTier,
    HostTierConfig,
    IntegrityError,
    LayoutError,
    ModelFingerprint,
    SegmentStore,
    tree_digest,
)
from kmesh_host.segment import (
    FORMAT_VERSION,
    MAX_PAYLOAD,
    PAYLOAD_ALIGNMENT,
    decode_header,
    encode_segment,
    read_schema_head,
)
from tests.helpers.dictfs import DictFS
from tests.helpers.segment_craft import craft, read_outcome

ROPE = {"base": 10000.0, "rotary_dim": 8, "is_neox_style": True}


def fp_for(dtype, L, H, D):
    return ModelFingerprint("LlamaForCausalLM", L, H, D, dtype, ROPE)


def _padded(n):
    return -(-n // 4096) * 4096


def _marked_zeros(shape, dtype):
    """A zero tensor with distinct nonzero bytes at the ends, around 4 KiB and 256 MiB, and mid-way."""
    kv = torch.zeros(shape, dtype=dtype)
    flat = kv.view(-1).view(torch.uint8)
    n = flat.numel()
    spots = sorted(s for s in {0, 1, 4095, 4096, n // 2 + 3, (1 << 28) - 1, 1 << 28, n - 1} if s < n)
    for i, at in enumerate(spots):
        flat[at] = i + 1
    return kv, [(at, i + 1) for i, at in enumerate(spots)]


# ---------------------------------------------------------------------- past 256 MiB
BIG = {  # fingerprint, shape, dtype: 4096 or 4000 bytes per token
    "256MiB-65536-tokens": (fp_for("bfloat16", 4, 2, 128), (2, 4, 65536, 2, 128), torch.bfloat16),
    "256MiB+544-padded": (fp_for("float16", 1, 1, 1000), (2, 1, 67109, 1, 1000), torch.float16),
    "300MiB": (fp_for("bfloat16", 4, 2, 128), (2, 4, 76800, 2, 128), torch.bfloat16),
}


@pytest.mark.parametrize("case", list(BIG))
def test_put_get_verify_past_256_mib(tmp_path, case):
    fp, shape, dtype = BIG[case]
    kv, marks = _marked_zeros(shape, dtype)
    n, T = kv.numel() * kv.element_size(), shape[2]
    tok, pos = torch.arange(T) * 2, torch.arange(T) + 7
    store = SegmentStore(tmp_path / "store")
    key = store.put(kv, tok, pos, model_fingerprint=fp)
    h = store.read_header(key)
    assert (h.version, h.payload_length, h.padded_length) == (FORMAT_VERSION, n, _padded(n))
    assert h.payload_offset % PAYLOAD_ALIGNMENT == 0 and n > (1 << 28) - PAYLOAD_ALIGNMENT
    seg = store.get(key, model_fingerprint=fp, check="tree")
    assert torch.equal(seg.kv.view(torch.uint8), kv.view(torch.uint8))
    assert torch.equal(seg.token_ids, tok) and torch.equal(seg.positions, pos)
    del seg
    assert store.verify(key).key == key and store.keys() == [key] and store.stats["writes"] == 1
    # plain pyarrow, memory-mapped: the payload column's value bytes are one aligned range of the
    # file, where the header says (what O_DIRECT, cuFile and the GPU routes read), holding the payload
    with pa.memory_map(store.path(key)) as mm:
        col = pa.ipc.open_file(mm).get_batch(0).column("payload")
        assert col.type == pa.large_binary() and col.null_count == 0
        values = col.buffers()[2]
        mm.seek(0)
        assert values.address - mm.read_buffer(1).address == h.payload_offset and values.size == h.padded_length
        region = np.frombuffer(values, dtype=np.uint8)
        assert all(region[at] == v for at, v in marks)
        assert tree_digest(region) == h.tree_root
        del region, values, col
    with HostTier(store, HostTierConfig(pin=False, verify="sha256")) as tier:   # O_DIRECT reads by offset
        lease = tier.acquire(key, model_fingerprint=fp)
        assert torch.equal(lease.kv.view(torch.uint8), kv.view(torch.uint8))
        lease.release()


# ---------------------------------------------------------------------- the limit
@pytest.mark.slow
def test_a_payload_at_the_format_limit_is_encoded_and_read(tmp_path):
    D = 2048
    T = MAX_PAYLOAD // (2 * D)
    assert 2 * T * D == MAX_PAYLOAD
    fp = fp_for("uint8", 1, 1, D)
    flat = torch.from_numpy(np.zeros(MAX_PAYLOAD, dtype=np.uint8))   # zero pages until touched
    marks = [(0, 1), (4096, 2), (1 << 28, 3), (1 << 30, 4), (MAX_PAYLOAD - 1, 5)]
    for at, v in marks:
        flat[at] = v
    key, data = encode_segment(flat.view(2, 1, T, 1, D), torch.arange(T), torch.arange(T), model_fingerprint=fp)
    off, padded = read_schema_head(memoryview(data)[:65536], key, data.size)
    assert padded == MAX_PAYLOAD and off % PAYLOAD_ALIGNMENT == 0
    h = decode_header(data, key, payload_offset=off, padded_length=padded)
    assert h.key == key and h.dense_kv
    # exactly the bytes encoded: zeros but for the marks, where they were put (the digests in the
    # header are those of these bytes: computed from them before the file was written)
    payload = np.frombuffer(data, dtype=np.uint8, offset=off, count=padded)
    assert all(payload[at] == v for at, v in marks) and np.count_nonzero(payload) == len(marks)
    # the store finds and parses it: a sparse copy of the file (its zero pages are holes)
    store = SegmentStore(tmp_path / "store")
    path = store.path(key)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(memoryview(data)[:off])
        for at, v in marks:
            f.seek(off + at)
            f.write(bytes([v]))
        f.seek(off + padded)
        f.write(memoryview(data)[off + padded:])
    del payload, data
    assert store.keys() == [key] and key in store
    got = store.read_header(key)
    assert (got.key, got.payload_offset, got.padded_length) == (key, off, MAX_PAYLOAD)


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")   # a shape, no data: any copy would fail


@pytest.mark.parametrize("shape,dtype", [
    ((2, 1, 524288, 1, 2048), torch.uint8),          # one chunk over: exactly 2 GiB
    ((2, 1, 1073739777, 1, 1), torch.uint8),         # MAX_PAYLOAD + 2 bytes: over once padded
    ((2, 32, 1 << 20, 8, 128), torch.bfloat16),      # 128 GiB
], ids=["2GiB", "limit+2", "128GiB"])
def test_over_the_limit_is_refused_before_anything_is_copied(tmp_path, shape, dtype):
    _, L, T, H, D = shape
    fp = fp_for(str(dtype).removeprefix("torch."), L, H, D)
    tok = _meta((T,), torch.int64)
    with pytest.raises(LayoutError, match="limit"):
        encode_segment(_meta(shape, dtype), tok, tok, model_fingerprint=fp)
    store = SegmentStore(tmp_path / "store")
    with pytest.raises(LayoutError, match="limit"):
        store.put(_meta(shape, dtype), tok, tok, model_fingerprint=fp)
    assert store.keys() == [] and [f for _, _, fs in os.walk(store.root) for f in fs] == []


def test_a_file_claiming_a_payload_over_the_limit_is_refused(tmp_path):
    fp = fp_for("float16", 2, 2, 8)
    kv, tok, pos = torch.ones(2, 2, 5, 2, 8, dtype=torch.float16), torch.arange(5), torch.arange(5)
    store = SegmentStore(tmp_path / "store")
    key = store.put(kv, tok, pos, model_fingerprint=fp)
    claim = MAX_PAYLOAD + PAYLOAD_ALIGNMENT
    lying = _rewrite_metadata(open(store.path(key), "rb").read(), **{"kmesh.payload_bytes": f"{claim:016d}"})
    offset = store.read_header(key).payload_offset
    with open(store.path(key), "wb") as f:
        f.write(lying)
        f.truncate(offset + claim + 4096)   # sparse: the claimed payload fits in the file's size
    for op in ("get", "verify", "read_header"):
        with pytest.raises(IntegrityError, match=f"{key}.*holds 1 to {MAX_PAYLOAD}"):
            store.get(key, model_fingerprint=fp) if op == "get" else getattr(store, op)(key)
    assert store.keys() == [] and key not in store


# ---------------------------------------------------------------------- version 1 files
# A segment file as put() wrote it before version 2 (format version 1), zlib + base64: _v1_item().
V1_FILE = "".join([
    "eNrtWl1oHFUUvkk3NdFtG9aobdOHEB1IoYbN5mebNm03bTbZ2Z2fe/PSwiqbaTLbLNnMht1N01iFfSkkKKUOVYMpUsSFFkoo"
    "BZmCPuRBH5aKSF6MzkuhjcQKS/ElFVPjvfOTHS+J9EVRmBNO7pw53zn3nHvPvTPM3t7BQfF0GwAbmMBOAOoBoefBbizUgFp8"
    "hanKs3nfi/97rPtfGtcA7MD8NuaIJc9hX03WNbHzO6jD391FPDVgHhuXc6OtE9J0OiONJDLJZE7OE90ytq+37Ksw4/DArk38"
    "eTmbS2UULNfiaEgstfj6gIXfxL2ek8+Nywpx6N20TWay45LRB/H/EBtcw5zH7MFJLFcDcAFzA+bbuOM85h7MXszLGH8N8wjm"
    "Dquv9O94zEDVHuJrr3WP0HOYrazAJwSDAXMm1lPviJVQHWYpnTqnJCYk4vs9jPvKxFbT2Bcw57OynEhKSmYyD2bWCQ5UkbF+"
    "4rBpctjstm3SspRM5FJvyQAsOuz865Uc6LgMu2wmQwYsuW7O6dD61jnj0gG5USnQiWdXtbDvrW+dB6md4dFJZcyKBz6txLO4"
    "vn0edqWkZeVcfhSAGcsuRPI37bwNDrsqK0aSy0Qml8rjssnh68cY2/K00o8zD9Km8vI4uV51+D/z9O/95zNjspJIjRD/JJ+Z"
    "Z/Af+aPi/67D/wGHfyLXmGM7gYcK3MK4h8/g+zOH7wbjuqqGxhO/I/lpw68HY3pM3K4WR42TeX0NB/IQtzfIOGLus/yQekym"
    "lHNydiKbwiuN5FPYpi/SZjNGV2ACY248Q0xzGPPdH1vXEBnzURkXg1lC4OpGpYY8G1vXENkHlMnxxNj5BDElUwW+cdj1OOxe"
    "o+qV2KWlabz3mPtOLV7ltabasL2wUcmH7lPKDo/ieRnOT2bN/DH2hgPf4MCTvXRMnjby+WabPMj+UtkFd+I4PMY81RvcgOWd"
    "GOM1JHPfNvs5QK1Xezf0GH8mkefAaI0Zkxn/y9aTwGt4BDs8xnwVbAAenb3WPkzG6doOM44qUKHDYHuqpdpdVruXwtlytdU2"
    "Ufomyk+L1YasdpTCbyfb9hNWW2+1BQpfcNQ1oRlKP0Ppr1D6K5R+jtLPUfFcd8w9sNaik25Q+NtW22G1qxR+lcI/pvw/ofBP"
    "KPxfJtgh2+PeQult2bb3U3o/ZX+G0p+h7Ico/RBlP0PpZyj7K5Teljfng9Lbsl1ndyn9XUq/TOmXKf/3Kf19Sr9K6Vep+B9b"
    "8hVrQRQ8VH16qALGtG/7afvfyDX/sP7flsE276xOHNnDOgPJgF8O+Nv97W3J9ja/fFjulKTugNTe6Ze6O7o6A0H/WSkQ6Aj6"
    "u7oDbW1Buast0H22c3i4vUsKdHTapcClpXGpP5M9JU3mpDTHV1P7aq2jX7IXJPEbV76ta3Mvudh8VsrJzUfayMt8q/9QcyqX"
    "UOTMhUQuP53G9/PZSflQczaTl7LTiZHUePORw+9s56/G0W81NT9bxeOcux2O55j9PmA/b534F6j7uxzvk4T22Oul+q/r5cEv"
    "hdXTjxYu/VL7Ytf+pZ/Aqz+8dN/38Y8Dzff2Ty4+enji3c8//ODq+7euHrt3+U3x+r7v3v30jWXvb2fa+X0tnz5oDh61/YSc"
    "e0w1cMml/xipfrVD71IPa936EdCj9jDHtGPscf24cgKE2JAa0kNMr9Kr9YKT7En1pH6SOaWc0k6BPqaP7VP61D6tT+8DYSbM"
    "hpWwGtbCehj0M/1sv9Kv9mv9ej8YYAbYAWVAHdAG9AEQ8UWYSDDCRuIRJVKIqJFiRIuUInqkHAGsj2XYIMuycVZhC6zKFlmN"
    "LbE6W2ZB1BdlosEoG41HlWghqkaLUS1aiurRchTEfDEmFoyxsXhMiRViaqwY02KlmB4rxwBXx/m4Ro7hWrkgF+JYbpCLczKn"
    "cFNcgZvlVG6eK3ILnMYtciVuidO5Fa7MrXGAr+N9fCPP8K18kA/xLD/Ix3mZV/gpvsDP8io/zxf5BV7jF/kSv8Tr/Apf5td4"
    "INQJPqFRYIRWISiEBFYYFOKCLCjClFAQZgVVmBeKwoKgCYtCSVgSdGFFKAtrAhDrRJ/YKDJiqxgUQyIrDopxURYVcUosiLOi"
    "Ks6LRXFB1MRFsSQuibq4IpbFNRHAGlgHd0MffAU2wibIwIOwFQZgEB6FIRiGLBTgIDwN43AIyjAFFZiFU/AiLMBLcBZehir8"
    "CM7D67AIb8IFeAdq8Au4CL+GJfgtXILfQx3ehyvwZ1iGv8I1+DsEqAbVod3Ih15BjagJMeggakUBFERHUQiFEYsENIhOozga"
    "QjJKIQVl0RS6iAroEppFl5GKPkLz6DoqoptoAd1B7vpzySWXXHLJJZdccskll1z6d2jD/P3L+FzlBQ3Gr0leLJnfyzygB5jf"
    "1O3fI+utD24T1se4yu9ANrlnBNwzAu4Zga38u2cE3DMC//czAi34Zq9xZuxPIjrQSw=="
])


def _v1_item():
    T = 5
    kv = (torch.arange(2 * 2 * T * 2 * 8, dtype=torch.float32).reshape(2, 2, T, 2, 8) / 7).to(torch.float16)
    return kv, torch.arange(T) * 3, torch.arange(T) + 11, fp_for("float16", 2, 2, 8)


def _root(kind, tmp_path):
    if kind == "local":
        return SegmentStore(tmp_path / "store")
    return SegmentStore("/store", filesystem=pafs.PyFileSystem(DictFS()))


def _write(store, path, data):
    store.filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with store.filesystem.open_output_stream(path) as out:
        out.write(bytes(data))


def _read(store, path):
    with store.filesystem.open_input_file(path) as f:
        return f.read()


@pytest.mark.parametrize("kind", ["local", "dict"])
def test_a_version_1_file_written_before_version_2_still_reads(tmp_path, kind):
    kv, tok, pos, fp = _v1_item()
    old = zlib.decompress(base64.b64decode(V1_FILE))
    key, _ = encode_segment(kv, tok, pos, model_fingerprint=fp)            # a version 2 encoding
    v1_key, crafted, _ = craft(kv, tok, pos, fp, version=1)
    assert v1_key == key and bytes(crafted) == old    # same key; the helper writes exactly the old files
    table = pa.ipc.open_file(pa.py_buffer(old)).read_all()                 # plain pyarrow, version 1
    assert table.schema.metadata[b"kmesh.version"] == b"1" and table.column("key")[0].as_py() == key
    assert table.schema.field("payload").type == pa.binary(4096)
    store = _root(kind, tmp_path)
    _write(store, store.path(key), old)
    assert store.read_header(key).version == 1
    for op in ("get", "verify", "read_header"):
        assert read_outcome(store, key, kv, tok, pos, op, fp=fp) == "same"
    assert store.get(key, model_fingerprint=fp, check="tree").key == key
    assert store.keys() == [key] and key in store
    assert store.put(kv, tok, pos, model_fingerprint=fp) == key
    assert store.stats["writes"] == 0 and _read(store, store.path(key)) == old   # found, kept as it is
    other = store.put(kv + 1, tok, pos, model_fingerprint=fp)                       # written as version 2
    assert store.read_header(other).version == FORMAT_VERSION == 2 and store.keys() == sorted([key, other])
    if store.local:
        with HostTier(store, HostTierConfig(pin=False, verify="sha256")) as tier:
            for k, want in ((key, kv), (other, kv + 1)):
                lease = tier.acquire(k, model_fingerprint=fp)
                assert torch.equal(lease.kv.view(torch.uint8), want.view(torch.uint8))
                lease.release()
    store.delete(key)
    assert store.keys() == [other]


@pytest.mark.parametrize("dtype,shape,chunk", [
    (torch.float32, (2, 1, 1, 1, 2), 4096), (torch.bfloat16, (2, 3, 300, 2, 8), 4096),
    (torch.uint8, (2, 2, 17, 1, 64), 512), (torch.float8_e4m3fn, (2, 2, 9, 2, 8), 1024),
], ids=["f32-T1", "bf16-T300", "u8-chunk512", "fp8-chunk1024"])
def test_version_1_files_of_every_kind_read(tmp_path, dtype, shape, chunk):
    _, L, T, H, D = shape
    name = "float8_e4m3fn" if dtype in (torch.uint8, torch.float8_e4m3fn) else str(dtype).removeprefix("torch.")
    fp = fp_for(name, L, H, D)
    g = torch.Generator().manual_seed(T)
    kv = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 \
        else torch.randn(shape, generator=g).to(dtype)
    tok, pos = torch.arange(T) + 100, torch.arange(T) * 2
    key, data, _ = craft(kv, tok, pos, fp, version=1, chunk_size=chunk)
    store = SegmentStore(tmp_path / "store", chunk_size=chunk)
    _write(store, store.path(key), data)
    assert store.read_header(key).version == 1
    for op in ("get", "verify"):
        assert read_outcome(store, key, kv, tok, pos, op, fp=fp) == "same"
    assert store.put(kv, tok, pos, model_fingerprint=fp) == key and store.stats["writes"] == 0


def _rewrite_metadata(data, **changes):
    """``data`` rewritten by plain pyarrow with schema metadata changed (a value of None drops it);
    values of the same width leave the layout as it was."""
    reader = pa.ipc.open_file(pa.py_buffer(data))
    meta = dict(reader.schema.metadata)
    for k, v in changes.items():
        if v is None:
            meta.pop(k.encode(), None)
        else:
            meta[k.encode()] = v.encode()
    schema = reader.schema.with_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        w.write_batch(pa.RecordBatch.from_arrays(reader.get_batch(0).columns, schema=schema))
    return sink.getvalue()


LIES = {   # each a file of one version claiming (part of) the other
    "v1-layout-says-2": lambda *item: _rewrite_metadata(craft(*item, version=1)[1], **{
        "kmesh.version": "2", "kmesh.payload_bytes": "0000000000004096"}),
    "v2-layout-says-1": lambda *item: _rewrite_metadata(craft(*item)[1], **{"kmesh.version": "1"}),
    "v1-row-says-2": lambda *item: craft(*item, version=1, overrides={"version": 2})[1],
    "v2-row-says-1": lambda *item: craft(*item, overrides={"version": 1})[1],
    "v2-without-payload-bytes": lambda *item: _rewrite_metadata(craft(*item)[1], **{"kmesh.payload_bytes": None}),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_version_lies_are_refused(tmp_path, lie):
    kv, tok, pos, fp = _v1_item()
    key, _ = encode_segment(kv, tok, pos, model_fingerprint=fp)
    store = SegmentStore(tmp_path / "store")
    _write(store, store.path(key), LIES[lie](kv, tok, pos, fp))
    for op in ("get", "verify", "read_header"):
        assert read_outcome(store, key, kv, tok, pos, op, fp=fp) == "refused"
