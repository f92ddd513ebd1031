"""SegmentStore: round trips, restart, idempotence, concurrency, and every kind of bad file."""

from __future__ import annotations

import os
import random
import threading

import pyarrow as pa
import pytest
import torch

import kmesh_host.segment as segment_mod
from kmesh_host import (
    FingerprintMismatch,
    IntegrityError,
    KmeshError,
    ModelFingerprint,
    SegmentNotFound,
    SegmentStore,
    StorageError,
)

ROPE = {"base": 10000.0, "rotary_dim": 8, "is_neox_style": True}


def fp_for(dtype: str, L=2, H=2, D=8):
    return ModelFingerprint("LlamaForCausalLM", L, H, D, dtype, ROPE)


def make_kv(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.uint8, torch.float8_e4m3fn):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.fixture
def store(tmp_path):
    return SegmentStore(tmp_path / "store")


def put_one(store, T=5, dtype=torch.float16, seed=0, fp=None):
    fp = fp or fp_for(str(dtype).removeprefix("torch."))
    kv = make_kv((2, 2, T, 2, 8), dtype, seed)
    tok = torch.arange(T) * 3
    pos = torch.arange(T) + 11
    return store.put(kv, tok, pos, model_fingerprint=fp), kv, tok, pos, fp


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.float8_e4m3fn]
SHAPES = [(2, 1, 1, 1, 2), (2, 3, 17, 2, 8), (2, 2, 300, 1, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_round_trip(store, dtype, shape):
    _, L, T, H, D = shape
    fp = fp_for(str(dtype).removeprefix("torch."), L, H, D)
    kv = make_kv(shape, dtype)
    tok, pos = torch.randint(0, 50000, (T,)), torch.arange(T) + 1000
    key = store.put(kv, tok, pos, model_fingerprint=fp)
    seg = store.get(key, model_fingerprint=fp)
    assert seg.kv.dtype == dtype and seg.kv.shape == shape
    assert torch.equal(seg.kv.view(torch.uint8), kv.view(torch.uint8))
    assert torch.equal(seg.token_ids, tok) and torch.equal(seg.positions, pos)
    assert seg.key == key and seg.fingerprint == fp
    for check in ("tree", "both"):
        assert torch.equal(store.get(key, model_fingerprint=fp, check=check).kv.view(torch.uint8),
                           kv.view(torch.uint8))
    assert store.verify(key).key == key


def test_non_contiguous_input(store):
    fp = fp_for("float32")
    base = make_kv((2, 5, 2, 2, 8), torch.float32)
    kv = base.transpose(1, 2)  # (2, 2, 5, 2, 8), not contiguous
    key = store.put(kv, torch.arange(5), torch.arange(5), model_fingerprint=fp)
    assert torch.equal(store.get(key, model_fingerprint=fp).kv, kv)


def test_restart_finds_everything(tmp_path):
    root = tmp_path / "store"
    first = SegmentStore(root)
    items = [put_one(first, T=3 + i, seed=i) for i in range(4)]
    second = SegmentStore(str(root))
    assert second.keys() == sorted(k for k, *_ in items)
    for key, kv, tok, pos, fp in items:
        seg = second.get(key, model_fingerprint=fp)
        assert torch.equal(seg.kv, kv) and torch.equal(seg.positions, pos)
    uri = SegmentStore("file://" + str(root))
    assert uri.keys() == second.keys()


def test_identical_puts_are_idempotent(store):
    key, kv, tok, pos, fp = put_one(store)
    again = store.put(kv.clone(), tok.clone(), pos.clone(), model_fingerprint=fp)
    assert again == key and store.keys() == [key]
    assert store.stats["writes"] == 1


def test_put_replaces_a_damaged_copy(store):
    key, kv, tok, pos, fp = put_one(store)
    path = store.path(key)
    with open(path, "r+b") as f:
        f.seek(store.read_header(key).payload_offset)
        f.write(b"\xff")
    with pytest.raises(IntegrityError):
        store.get(key, model_fingerprint=fp)
    assert store.put(kv, tok, pos, model_fingerprint=fp) == key
    assert torch.equal(store.get(key, model_fingerprint=fp).kv, kv)


def test_concurrent_writers_of_one_key(store):
    fp = fp_for("float16")
    kv = make_kv((2, 2, 40, 2, 8), torch.float16)
    keys, errors = [], []
    barrier = threading.Barrier(8)

    def writer():
        try:
            barrier.wait(timeout=10)
            keys.append(store.put(kv, torch.arange(40), torch.arange(40), model_fingerprint=fp))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(set(keys)) == 1 and len(keys) == 8
    shard = os.path.dirname(store.path(keys[0]))
    assert os.listdir(shard) == [os.path.basename(store.path(keys[0]))]  # no temporaries left
    store.verify(keys[0])


def test_wrong_model_fingerprint(store):
    key, *_ = put_one(store)
    other = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "float16", {"base": 500000.0})
    with pytest.raises(FingerprintMismatch, match=key):
        store.get(key, model_fingerprint=other)


def test_missing_and_invalid_keys(store):
    fp = fp_for("float16")
    missing = "ab" * 32
    with pytest.raises(SegmentNotFound, match=missing):
        store.get(missing, model_fingerprint=fp)
    with pytest.raises(SegmentNotFound):
        store.verify(missing)
    with pytest.raises(SegmentNotFound):
        store.get("../../etc/passwd", model_fingerprint=fp)
    with pytest.raises(SegmentNotFound):
        store.delete(missing)
    store.delete(missing, missing_ok=True)
    key, *_ = put_one(store)
    assert key in store and missing not in store
    store.delete(key)
    assert store.keys() == [] and key not in store
    with pytest.raises(SegmentNotFound):
        store.get(key, model_fingerprint=fp)


def _assert_never_wrong(store, key, fp, kv):
    """Either a KmeshError naming the key, or exactly the stored data."""
    try:
        seg = store.get(key, model_fingerprint=fp)
    except KmeshError as exc:
        assert key in str(exc)
        return True
    assert torch.equal(seg.kv.view(torch.uint8), kv.view(torch.uint8))
    return False


def test_payload_bit_flips(store):
    key, kv, tok, pos, fp = put_one(store, T=70)
    path = store.path(key)
    header = store.read_header(key)
    clean = open(path, "rb").read()
    spots = [0, 1, header.payload_length // 2, header.payload_length - 1, header.padded_length - 1]
    for spot in spots:
        bad = bytearray(clean)
        bad[header.payload_offset + spot] ^= 0x10
        open(path, "wb").write(bad)
        with pytest.raises(IntegrityError, match=key):
            store.get(key, model_fingerprint=fp)
        with pytest.raises(IntegrityError, match=key):
            store.verify(key)
        store.read_header(key)  # metadata is intact: the header alone still reads


def test_metadata_bit_flips_never_give_wrong_data(store):
    key, kv, tok, pos, fp = put_one(store, T=9)
    path = store.path(key)
    header = store.read_header(key)
    clean = open(path, "rb").read()
    end = header.payload_offset + header.padded_length
    meta_positions = list(range(0, header.payload_offset)) + list(range(end, len(clean)))
    rng = random.Random(4)
    # Always the magic, the schema and the batch metadata; a sample of the rest.
    chosen = sorted(set(range(0, 64)) | set(rng.sample(meta_positions, 160)) | set(range(len(clean) - 16, len(clean))))
    refused = 0
    for spot in chosen:
        bad = bytearray(clean)
        bad[spot] ^= 1 << rng.randrange(8)
        open(path, "wb").write(bad)
        refused += _assert_never_wrong(store, key, fp, kv)
    assert refused > len(chosen) // 2  # most metadata bytes matter; the rest are alignment padding


def test_altered_field_is_detected_by_the_key(store):
    key, kv, tok, pos, fp = put_one(store, T=9)
    path = store.path(key)
    data = bytearray(open(path, "rb").read())
    # Position 11 is stored as int64 little endian; change it to 12 without breaking Arrow.
    needle = (11).to_bytes(8, "little") + (12).to_bytes(8, "little")
    at = bytes(data).index(needle)
    data[at] = 12
    open(path, "wb").write(data)
    with pytest.raises(IntegrityError, match="altered"):
        store.get(key, model_fingerprint=fp)


@pytest.mark.parametrize("cut", ["empty", "magic", "head", "payload", "footer"])
def test_truncated_files(store, cut):
    key, kv, tok, pos, fp = put_one(store, T=70)
    path = store.path(key)
    header = store.read_header(key)
    clean = open(path, "rb").read()
    length = {"empty": 0, "magic": 5, "head": header.payload_offset - 7,
              "payload": header.payload_offset + header.padded_length // 2, "footer": len(clean) - 1}[cut]
    open(path, "wb").write(clean[:length])
    with pytest.raises(IntegrityError, match=key):
        store.get(key, model_fingerprint=fp)
    with pytest.raises(IntegrityError, match=key):
        store.read_header(key)


def test_foreign_and_garbage_files(store):
    key, kv, tok, pos, fp = put_one(store)
    path = store.path(key)
    table = pa.table({"x": [1, 2, 3]})
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(IntegrityError, match="foreign"):
        store.get(key, model_fingerprint=fp)
    open(path, "wb").write(os.urandom(20000))
    with pytest.raises(IntegrityError, match=key):
        store.get(key, model_fingerprint=fp)
    open(path, "wb").write(b"ARROW1\0\0" + os.urandom(9000) + b"ARROW1")
    with pytest.raises(IntegrityError, match=key):
        store.get(key, model_fingerprint=fp)


def test_another_segments_file_under_this_key(store):
    key_a, *_ = put_one(store, seed=0)
    key_b, kv_b, _, _, fp = put_one(store, seed=1)
    open(store.path(key_a), "wb").write(open(store.path(key_b), "rb").read())
    with pytest.raises(IntegrityError, match=key_a):
        store.get(key_a, model_fingerprint=fp)


def test_wrong_format_version(store, monkeypatch):
    monkeypatch.setattr(segment_mod, "FORMAT_VERSION", 3)   # a file from a future writer
    key, kv, tok, pos, fp = put_one(store)
    monkeypatch.undo()
    for op in ("get", "verify", "read_header"):
        with pytest.raises(IntegrityError, match=f"{key}.*version '3'"):
            store.get(key, model_fingerprint=fp) if op == "get" else getattr(store, op)(key)


@pytest.mark.parametrize("fail_at", ["write", "fsync", "replace"])
def test_failed_write_leaves_no_file(store, monkeypatch, fail_at):
    target = {"write": os, "fsync": os, "replace": os}[fail_at]
    real = getattr(target, fail_at)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if fail_at == "write" and calls["n"] == 1:
            real(args[0], bytes(args[1])[:100])  # a partial write, then the disk fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(target, fail_at, failing)
    with pytest.raises(StorageError):
        put_one(store)
    monkeypatch.setattr(target, fail_at, real)
    leftovers = [os.path.join(d, f) for d, _, fs in os.walk(store.root) for f in fs]
    assert leftovers == [] and store.keys() == []


def test_remove_temporaries(store):
    key, *_ = put_one(store)
    shard = os.path.dirname(store.path(key))
    open(os.path.join(shard, f".{key}.arrow.1.dead.tmp"), "wb").write(b"partial")
    assert store.keys() == [key]
    assert store.remove_temporaries() == 1
    assert os.listdir(shard) == [os.path.basename(store.path(key))]


def test_pyarrow_filesystem_uri():
    store = SegmentStore("mock:///kmesh")
    key, kv, tok, pos, fp = put_one(store, T=33, dtype=torch.bfloat16)
    assert store.keys() == [key] and not store.local
    assert torch.equal(store.get(key, model_fingerprint=fp).kv, kv)
    assert store.read_header(key).key == key
    assert put_one(store, T=33, dtype=torch.bfloat16)[0] == key
    store.delete(key)
    assert store.keys() == []
    with pytest.raises(SegmentNotFound):
        store.get(key, model_fingerprint=fp)
    with pytest.raises(StorageError):
        store.local_path(key)
