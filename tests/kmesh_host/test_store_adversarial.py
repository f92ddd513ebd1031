"""SegmentStore against hostile files, failing writes and concurrent writers (seeded, reproducible).

The rule every check asserts: whatever a file under a segment's name contains, ``get``/``verify``/
``read_header`` either give exactly the data that was written or raise a :class:`KmeshError` whose
message names the segment; a failed write leaves no file behind but (at most) a complete one.
What test_store.py already covers (a few payload flips, 160 sampled metadata flips, five truncation
points, foreign/garbage files, another key's file for ``get``) is extended here, not repeated.
"""

from __future__ import annotations

import errno
import functools
import json
import multiprocessing as mp
import os
import random
import threading
import types

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from kmesh_host import (
    IntegrityError,
    KmeshError,
    ModelFingerprint,
    SegmentNotFound,
    SegmentStore,
    StorageError,
)
from kmesh_host.integrity import sha256, tree_digest
from kmesh_host.segment import (
    FORMAT_NAME,
    FORMAT_VERSION,
    PAYLOAD_ALIGNMENT,
    derive_key,
    dtype_name,
    payload_array,
    payload_bytes,
    segment_schema,
)
from tests.helpers.segment_craft import read_outcome

ROPE = {"base": 10000.0, "rotary_dim": 8, "is_neox_style": True}
FP = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "float16", ROPE)


def make_item(T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, T, 2, 8), generator=g).to(torch.float16)
    return kv, torch.arange(T) * 3 + seed, torch.arange(T) + 11


@pytest.fixture
def store(tmp_path):
    return SegmentStore(tmp_path / "store")


@pytest.fixture
def stored(store):
    kv, tok, pos = make_item()
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    with open(store.path(key), "rb") as f:
        clean = f.read()
    return store, key, kv, tok, pos, clean


def write(path, data) -> None:
    with open(path, "wb") as f:
        f.write(bytes(data))


def call(store, key, op):
    return store.get(key, model_fingerprint=FP) if op == "get" else getattr(store, op)(key)



outcome = functools.partial(read_outcome, fp=FP)  # get / verify / read_header: "same" or "refused"


# ------------------------------------------------------------------ byte-level damage
def test_every_metadata_byte_flipped(stored):
    """One random bit of every byte before the alignment padding (magic, schema, batch metadata,
    the token and position buffers), of every other footer byte and of the last 64, and of a
    sample of the padding; each read with a random check mode."""
    store, key, kv, tok, pos, clean = stored
    h = store.read_header(key)
    end = h.payload_offset + h.padded_length
    image = pa.py_buffer(clean)
    batch = pa.ipc.open_file(image).get_batch(0)
    pad_at = batch.column(batch.num_columns - 2).buffers()[2].address - image.address  # align_pad's zeros
    assert 0 < pad_at < h.payload_offset
    rng = random.Random(11)
    seen = {"same": 0, "refused": 0}
    spots = list(range(0, pad_at)) + rng.sample(range(pad_at, h.payload_offset), 64)
    spots += list(range(end, len(clean) - 64, 2)) + list(range(len(clean) - 64, len(clean)))
    for i in spots:
        bad = bytearray(clean)
        bad[i] ^= 1 << rng.randrange(8)
        write(store.path(key), bad)
        seen[outcome(store, key, kv, tok, pos, "get", rng.choice(["sha256", "tree", "both"]))] += 1
    assert seen["refused"] > 1000 and seen["same"] > 0  # align padding is unchecked, by design


def test_random_metadata_overwrites_all_operations(stored):
    store, key, kv, tok, pos, clean = stored
    h = store.read_header(key)
    end = h.payload_offset + h.padded_length
    meta = [i for i in range(len(clean)) if not h.payload_offset <= i < end]
    rng = random.Random(12)
    for _ in range(400):
        bad = bytearray(clean)
        for _ in range(rng.randrange(1, 5)):
            bad[rng.choice(meta)] = rng.choice([0, 0xFF, rng.randrange(256)])
        write(store.path(key), bad)
        for op in ("read_header", "verify", "get"):
            outcome(store, key, kv, tok, pos, op)


@pytest.mark.parametrize("check", ["sha256", "tree", "both"])
def test_payload_damage_is_always_refused(stored, check):
    store, key, kv, tok, pos, clean = stored
    h = store.read_header(key)
    rng = random.Random(13)
    for _ in range(60):
        bad = bytearray(clean)
        for _ in range(rng.randrange(1, 4)):
            bad[h.payload_offset + rng.randrange(h.padded_length)] ^= 1 << rng.randrange(8)
        write(store.path(key), bad)
        with pytest.raises(IntegrityError, match=key):
            store.get(key, model_fingerprint=FP, check=check)
        assert store.read_header(key).key == key  # metadata intact


def test_truncation_at_many_lengths(stored):
    store, key, kv, tok, pos, clean = stored
    h = store.read_header(key)
    end = h.payload_offset + h.padded_length
    rng = random.Random(14)
    cuts = set(range(0, 80)) | set(range(h.payload_offset - 40, h.payload_offset + 40))
    cuts |= set(range(end - 8, len(clean))) | set(rng.sample(range(len(clean)), 300))
    for n in sorted(cuts):
        write(store.path(key), clean[:n])
        for op in ("get", "read_header"):
            assert outcome(store, key, kv, tok, pos, op) == "refused", n


@pytest.mark.parametrize("n", [1, 7, 8, 64, 4096, 70000])
def test_appended_bytes(stored, n):
    store, key, kv, tok, pos, clean = stored
    rng = random.Random(n)
    for tail in (bytes(n), bytes(rng.randrange(256) for _ in range(n)), b"ARROW1" * (n // 6 + 1)):
        write(store.path(key), clean + tail)
        for op in ("get", "verify", "read_header"):
            outcome(store, key, kv, tok, pos, op)


@pytest.mark.parametrize("blob", [b"", b"A", b"ARROW1", b"ARROW1\0\0", b"ARROW1\0\0" + bytes(4096) + b"ARROW1",
                                  b"ARROW1\0\0\xff\xff\xff\xff" + bytes(100) + b"ARROW1", bytes(9000)],
                         ids=["empty", "one", "magic", "magic-pad", "zeros-framed", "continuation", "zeros"])
def test_small_and_framed_junk(stored, blob):
    store, key, kv, tok, pos, _ = stored
    write(store.path(key), blob)
    for op in ("get", "verify", "read_header"):
        assert outcome(store, key, kv, tok, pos, op) == "refused"


# ------------------------------------------------------------------ valid Arrow that lies
def craft(kv, tok, pos, fp=FP, *, overrides=None, rekey=False, meta=None):
    """A segment file made like encode_segment's, with fields replaced (``overrides``), the key
    recomputed from them (``rekey``) or kept (a lie), and extra/changed schema metadata (``meta``).
    The payload stays 4096-aligned so that only the lie differs."""
    payload, length = payload_bytes(kv, 4096)
    sha, root = sha256(payload), tree_digest(payload)
    shape = [int(s) for s in kv.shape]
    cols = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
            "fingerprint": {"architecture": fp.architecture, "num_layers": fp.num_layers,
                            "num_kv_heads": fp.num_kv_heads, "head_size": fp.head_size, "dtype": fp.dtype,
                            "rope": fp.rope_json()},
            "dtype": dtype_name(kv.dtype), "shape": shape, "token_ids": np.asarray(tok, "<i8"),
            "positions": np.asarray(pos, "<i8"), "payload_length": length, "chunk_size": 4096,
            "sha256": sha, "tree_root": root, "tree_leaf_size": 4096, "tree_fanout": 64}
    cols["key"] = derive_key(fp, cols["dtype"], shape, cols["token_ids"], cols["positions"], length, 4096,
                             sha, root, 4096, 64)
    cols.update(overrides or {})
    if rekey:
        f = dict(cols["fingerprint"])
        try:
            fp2 = ModelFingerprint.from_dict({**f, "rope": json.loads(f["rope"])})
        except (KmeshError, ValueError, TypeError):  # not a valid fingerprint: any stable digest input
            fp2 = types.SimpleNamespace(to_dict=lambda: f)
        cols["key"] = derive_key(fp2, cols["dtype"], cols["shape"], cols["token_ids"], cols["positions"],
                                 cols["payload_length"], cols["chunk_size"], cols["sha256"], cols["tree_root"],
                                 cols["tree_leaf_size"], cols["tree_fanout"])
    parray = payload_array(payload)
    pad, offset = 0, 0
    for _ in range(8):
        schema = segment_schema(payload.nbytes, offset)
        if meta:
            schema = schema.with_metadata({**schema.metadata, **meta})
        arrays = [pa.array([cols[f.name]], type=f.type) for f in schema if f.name not in ("align_pad", "payload")]
        batch = pa.RecordBatch.from_arrays(arrays + [pa.array([bytes(pad)], pa.binary()), parray], schema=schema)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, schema) as w:
            w.write_batch(batch)
        data = sink.getvalue()
        reader = pa.ipc.open_file(data)
        actual = reader.get_batch(0).column(len(schema) - 1).buffers()[-1].address - data.address
        if actual == offset and actual % PAYLOAD_ALIGNMENT == 0:
            return cols["key"], data
        pad += (-actual) % PAYLOAD_ALIGNMENT
        offset = actual + (-actual) % PAYLOAD_ALIGNMENT
    raise AssertionError("could not align the crafted payload")


def test_craft_reproduces_put_exactly(stored):
    store, key, kv, tok, pos, clean = stored
    k, data = craft(kv, tok, pos)
    assert k == key and bytes(data) == clean


_FPD = {"architecture": FP.architecture, "num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float16",
        "rope": FP.rope_json()}
LIES = {
    "token_changed": {"token_ids": np.arange(9) * 4},
    "token_short": {"token_ids": np.arange(8)},
    "token_long": {"token_ids": np.arange(10), "positions": np.arange(10)},
    "positions_changed": {"positions": np.arange(9)},
    "shape_T": {"shape": [2, 2, 10, 2, 8]},
    "shape_neg": {"shape": [2, 2, -9, 2, 8]},
    "shape_huge": {"shape": [2, 2, 2 ** 62, 2, 8]},
    "shape_overflowing": {"shape": [2, 2 ** 40, 2 ** 40, 2 ** 40, 8]},
    "shape_4d": {"shape": [2, 2, 9, 16]},
    "shape_empty": {"shape": []},
    "shape_zero": {"shape": [2, 2, 0, 2, 8]},
    "dtype_bf16": {"dtype": "bfloat16"},
    "dtype_int32": {"dtype": "int32"},
    "dtype_float64": {"dtype": "float64"},
    "dtype_torch_prefix": {"dtype": "torch.float16"},
    "dtype_empty": {"dtype": ""},
    "dtype_uint8_reshaped": {"dtype": "uint8", "shape": [2, 2, 9, 2, 16]},
    "payload_length_neg": {"payload_length": -576},
    "payload_length_huge": {"payload_length": 2 ** 62},
    "payload_length_short": {"payload_length": 64},
    "chunk_0": {"chunk_size": 0},
    "chunk_neg": {"chunk_size": -4096},
    "chunk_odd": {"chunk_size": 4095},
    "chunk_512": {"chunk_size": 512},
    "leaf_0": {"tree_leaf_size": 0},
    "fanout_1": {"tree_fanout": 1},
    "sha_zero": {"sha256": bytes(32)},
    "root_zero": {"tree_root": bytes(32)},
    "version_1": {"version": 1},
    "version_3": {"version": 3},
    "format_other": {"format": "kmesh-segmenx"},
    "key_other": {"key": "ab" * 32},
    "fp_layers_neg": {"fingerprint": {**_FPD, "num_layers": -2}},
    "fp_layers_3": {"fingerprint": {**_FPD, "num_layers": 3}},
    "fp_arch_empty": {"fingerprint": {**_FPD, "architecture": ""}},
    "fp_dtype_bad": {"fingerprint": {**_FPD, "dtype": "float64"}},
    "fp_dtype_uint8": {"fingerprint": {**_FPD, "dtype": "uint8"}},
    "rope_not_json": {"fingerprint": {**_FPD, "rope": "{not json"}},
    "rope_null": {"fingerprint": {**_FPD, "rope": "null"}},
    "rope_list": {"fingerprint": {**_FPD, "rope": "[1, 2]"}},
    "rope_nan": {"fingerprint": {**_FPD, "rope": '{"base": NaN}'}},
    "rope_inf": {"fingerprint": {**_FPD, "rope": '{"base": 1e999}'}},
    "rope_bigint": {"fingerprint": {**_FPD, "rope": '{"base": ' + "9" * 5000 + "}"}},
    "rope_other": {"fingerprint": {**_FPD, "rope": '{"base": 500000.0}'}},
    "rope_shallow_nest": {"fingerprint": {**_FPD, "rope": '{"a":' + "[" * 50 + "]" * 50 + "}"}},
}


@pytest.mark.parametrize("rekey", [False, True], ids=["key-kept", "key-recomputed"])
@pytest.mark.parametrize("lie", sorted(LIES))
def test_lying_metadata_is_refused(stored, lie, rekey):
    """Valid Arrow, kmesh schema, aligned payload, one field lying; with the key kept (a changed
    field) or recomputed (a self-consistent file of another key under this key's name)."""
    store, key, kv, tok, pos, _ = stored
    _, data = craft(kv, tok, pos, overrides=LIES[lie], rekey=rekey and lie not in ("key_other",))
    write(store.path(key), data)
    for op in ("get", "verify", "read_header"):
        assert outcome(store, key, kv, tok, pos, op) == "refused"
    with pytest.raises(IntegrityError, match=key):
        store.get(key, model_fingerprint=FP, check="tree")


@pytest.mark.parametrize("meta", [
    {b"kmesh.payload_offset": b"0000000000000000"}, {b"kmesh.payload_offset": b"0000000000008192"},
    {b"kmesh.payload_offset": b"000000000000409x"}, {b"kmesh.payload_offset": b"4096"},
    {b"kmesh.payload_offset": b"-000000000004096"}, {b"kmesh.payload_offset": b"9999999999999999"},
    {b"kmesh.version": b"02"}, {b"kmesh.version": b"1"}, {b"kmesh.version": b"3"}, {b"kmesh.format": b"other"},
    {b"extra": b"x"}, {b"kmesh.payload_bytes": b"0000000000000000"}, {b"kmesh.payload_bytes": b"0000000000000512"},
    {b"kmesh.payload_bytes": b"0000000000008192"}, {b"kmesh.payload_bytes": b"4096"},
    {b"kmesh.payload_bytes": b"00000000000040960"}, {b"kmesh.payload_bytes": b"9999999999999999"},
], ids=lambda m: "-".join(f"{k.decode()}={v.decode()}" for k, v in m.items()))
def test_lying_schema_metadata_is_refused(stored, meta):
    store, key, kv, tok, pos, _ = stored
    _, data = craft(kv, tok, pos)
    reader = pa.ipc.open_file(data)
    batch = reader.get_batch(0)
    schema = reader.schema.with_metadata({**reader.schema.metadata, **meta})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        w.write_batch(pa.RecordBatch.from_arrays(batch.columns, schema=schema))
    write(store.path(key), sink.getvalue())
    for op in ("get", "verify", "read_header"):
        assert outcome(store, key, kv, tok, pos, op) == "refused"


def _rewrite(data, transform):
    table = pa.ipc.open_file(data).read_all()
    table = transform(table)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        for b in table.to_batches():
            w.write_batch(b)
    return sink.getvalue()


def _retype(table, name, typ):
    i = table.schema.get_field_index(name)
    return table.set_column(i, pa.field(name, typ), table.column(i).cast(typ))


REWRITES = {
    "swap_token_positions": lambda t: t.rename_columns(
        [{"token_ids": "positions", "positions": "token_ids"}.get(n, n) for n in t.column_names]),
    "swap_sha_root_values": lambda t: t.set_column(t.schema.get_field_index("sha256"), "sha256",
                                                   t.column("tree_root")),
    "version_int64": lambda t: _retype(t, "version", pa.int64()),
    "tokens_int32": lambda t: _retype(t, "token_ids", pa.list_(pa.int32())),
    "chunk_int64": lambda t: _retype(t, "chunk_size", pa.int64()),
    "payload_binary": lambda t: _retype(t, "payload", pa.binary()),
    "payload_fixed_size_binary": lambda t: _retype(t, "payload", pa.binary(t.column("payload")[0].as_buffer().size)),
    "payload_not_last": lambda t: t.select([t.column_names[-1]] + t.column_names[:-1]),
    "no_payload": lambda t: t.drop_columns(["payload"]),
    "no_align_pad": lambda t: t.drop_columns(["align_pad"]),
    "extra_column": lambda t: t.append_column("extra", pa.array([1])),
    "two_rows": lambda t: pa.concat_tables([t, t]).combine_chunks(),
    "two_batches": lambda t: pa.concat_tables([t, t]),
    "zero_rows": lambda t: t.slice(0, 0),
    "no_metadata": lambda t: t.replace_schema_metadata(None),
}


@pytest.mark.parametrize("name", sorted(REWRITES))
def test_pyarrow_rewrites_are_refused(stored, name):
    """Files rewritten by plain pyarrow: valid Arrow with the kmesh metadata kept, columns
    swapped/retyped/added/dropped, rows and batches multiplied (the payload offset moves, too)."""
    store, key, kv, tok, pos, clean = stored
    write(store.path(key), _rewrite(pa.py_buffer(clean), REWRITES[name]))
    for op in ("get", "verify", "read_header"):
        assert outcome(store, key, kv, tok, pos, op) == "refused"


def test_foreign_file_with_the_kmesh_schema_and_metadata(stored):
    """Same schema, same kmesh metadata, written by someone else: nulls everywhere."""
    store, key, kv, tok, pos, clean = stored
    schema = pa.ipc.open_file(pa.py_buffer(clean)).schema
    table = pa.table({f.name: pa.nulls(1, f.type) for f in schema}, schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        w.write_table(table)
    write(store.path(key), sink.getvalue())
    for op in ("get", "verify", "read_header"):
        assert outcome(store, key, kv, tok, pos, op) == "refused"


def test_another_valid_segment_under_this_name(store):
    items = [make_item(seed=s) for s in (0, 1)]
    (ka, *a), (kb, *b) = [(store.put(*it, model_fingerprint=FP), *it) for it in items]
    with open(store.path(kb), "rb") as f:
        write(store.path(ka), f.read())
    for op in ("get", "verify", "read_header"):
        assert outcome(store, ka, *a, op) == "refused"
    assert store.put(*a, model_fingerprint=FP) == ka  # put repairs it
    assert outcome(store, ka, *a, "get") == "same" and outcome(store, kb, *b, "get") == "same"


# ------------------------------------------------------------------ what sits at the path
def test_symlinks_at_the_path(stored, tmp_path):
    store, key, kv, tok, pos, clean = stored
    path = store.path(key)
    os.unlink(path)
    os.symlink(tmp_path / "nowhere", path)
    with pytest.raises(SegmentNotFound, match=key):
        store.get(key, model_fingerprint=FP)
    os.unlink(path)
    os.symlink(path, path)  # a loop
    with pytest.raises(StorageError, match=key):
        store.get(key, model_fingerprint=FP)
    os.unlink(path)
    os.symlink("/dev/zero", path)
    for op in ("get", "read_header"):
        assert outcome(store, key, kv, tok, pos, op) == "refused"
    os.unlink(path)
    write(tmp_path / "elsewhere.arrow", clean)
    os.symlink(tmp_path / "elsewhere.arrow", path)
    assert outcome(store, key, kv, tok, pos, "get") == "same"


def test_unreadable_file(stored, monkeypatch):
    store, key, kv, tok, pos, clean = stored
    path = store.path(key)
    if os.geteuid() != 0:  # root reads mode-000 files anyway; the os.open refusal below covers it
        os.chmod(path, 0)
        try:
            with pytest.raises(StorageError, match=key):
                store.get(key, model_fingerprint=FP)
        finally:
            os.chmod(path, 0o644)
    real_open = os.open

    def refusing(p, *a, **k):
        if str(p) == path:
            raise PermissionError(errno.EACCES, "Permission denied", p)
        return real_open(p, *a, **k)

    monkeypatch.setattr(os, "open", refusing)
    for op in ("get", "verify", "read_header"):
        with pytest.raises(StorageError, match=key):
            call(store, key, op)


def test_shard_directory_replaced_by_a_file(stored):
    store, key, kv, tok, pos, clean = stored
    shard = os.path.dirname(store.path(key))
    for name in os.listdir(shard):
        os.unlink(os.path.join(shard, name))
    os.rmdir(shard)
    write(shard, b"junk")
    for op in ("get", "verify", "read_header"):
        with pytest.raises(StorageError, match=key):
            call(store, key, op)
    with pytest.raises(StorageError, match=key):
        store.put(kv, tok, pos, model_fingerprint=FP)
    assert store.keys() == []
    os.unlink(shard)
    assert store.put(kv, tok, pos, model_fingerprint=FP) == key
    assert outcome(store, key, kv, tok, pos) == "same"


# ------------------------------------------------------------------ failing writes
def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_directory_fsync_failure_leaves_a_complete_file_or_none(store, monkeypatch):
    kv, tok, pos = make_item(seed=3)
    real = os.fsync
    calls = []

    def failing(fd):
        calls.append(fd)
        if len(calls) == 2:  # the directory's fsync, after the rename
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(StorageError) as info:
        store.put(kv, tok, pos, model_fingerprint=FP)
    monkeypatch.setattr(os, "fsync", real)
    assert not [f for f in _files(store.root) if f.endswith(".tmp")]
    for key in store.keys():  # the renamed file, if any, is complete
        assert key in str(info.value)
        assert outcome(store, key, kv, tok, pos) == "same"


@pytest.mark.parametrize("where", ["open-tmp", "makedirs"])
def test_other_write_failures(store, monkeypatch, where):
    kv, tok, pos = make_item(seed=4)
    if where == "open-tmp":
        real_open = os.open

        def failing(p, flags, *a, **k):
            if flags & os.O_CREAT:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_open(p, flags, *a, **k)
        monkeypatch.setattr(os, "open", failing)
    else:
        def failing(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(os, "makedirs", failing)
    with pytest.raises(StorageError):
        store.put(kv, tok, pos, model_fingerprint=FP)
    monkeypatch.undo()
    assert _files(store.root) == [] and store.keys() == []
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    assert outcome(store, key, kv, tok, pos) == "same"


def test_interrupt_mid_write_removes_the_temporary(store, monkeypatch):
    kv, tok, pos = make_item(seed=5)
    real = os.write

    def interrupted(fd, data):
        real(fd, bytes(data)[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put(kv, tok, pos, model_fingerprint=FP)
    monkeypatch.undo()
    assert _files(store.root) == []


class _FailingFS(pafs.FileSystemHandler):
    """A local filesystem seen through pyarrow.fs (not atomic PUT: temp name + move), failing on demand."""

    def __init__(self, fail=None):
        self.fs, self.fail = pafs.LocalFileSystem(), fail

    def __eq__(self, other):
        return isinstance(other, _FailingFS) and other.fail == self.fail

    def __ne__(self, other):
        return not self == other

    def get_type_name(self):
        return "failing"

    def normalize_path(self, p):
        return p

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, sel):
        return self.fs.get_file_info(sel)

    def create_dir(self, p, recursive):
        self.fs.create_dir(p, recursive=recursive)

    def delete_dir(self, p):
        self.fs.delete_dir(p)

    def delete_dir_contents(self, p, missing_dir_ok=False):
        self.fs.delete_dir_contents(p, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("no")

    def delete_file(self, p):
        self.fs.delete_file(p)

    def move(self, src, dest):
        if self.fail == "move":
            raise OSError(errno.ENOSPC, "No space left on device")
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, p):
        return self.fs.open_input_stream(p)

    def open_input_file(self, p):
        return self.fs.open_input_file(p)

    def open_output_stream(self, p, metadata):
        if self.fail == "open":
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.fs.open_output_stream(p)

    def open_append_stream(self, p, metadata):
        return self.fs.open_append_stream(p)


@pytest.mark.parametrize("fail", ["move", "open"])
def test_pyarrow_filesystem_write_failure(tmp_path, fail):
    kv, tok, pos = make_item(seed=6)
    store = SegmentStore(tmp_path / "fs", filesystem=pafs.PyFileSystem(_FailingFS(fail)))
    with pytest.raises(StorageError):
        store.put(kv, tok, pos, model_fingerprint=FP)
    assert _files(tmp_path / "fs") == [] and store.keys() == []
    good = SegmentStore(tmp_path / "fs", filesystem=pafs.PyFileSystem(_FailingFS()))
    key = good.put(kv, tok, pos, model_fingerprint=FP)
    assert outcome(good, key, kv, tok, pos) == "same" and good.keys() == [key]


# ------------------------------------------------------------------ concurrency
def test_concurrent_writers_and_readers_of_one_key(store):
    """Writers keep putting one key while readers read it: a reader
    sees SegmentNotFound (before the first rename) or exactly the data, never a partial file."""
    kv, tok, pos = make_item(T=40, seed=7)
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    store.delete(key)
    stop = threading.Event()
    errors, seen = [], {"same": 0, "missing": 0}
    barrier = threading.Barrier(6)

    def writer():
        try:
            barrier.wait(timeout=10)
            for _ in range(15):
                assert store.put(kv, tok, pos, model_fingerprint=FP) == key
        except BaseException as exc:
            errors.append(exc)

    def reader():
        try:
            barrier.wait(timeout=10)
            while not stop.is_set():
                try:
                    seg = store.get(key, model_fingerprint=FP)
                    assert torch.equal(seg.kv, kv) and torch.equal(seg.positions, pos)
                    seen["same"] += 1
                except SegmentNotFound:
                    seen["missing"] += 1
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=writer) for _ in range(4)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(timeout=60)
    stop.set()
    for t in readers:
        t.join(timeout=60)
    assert not errors, errors
    assert seen["same"] > 0
    assert _files(store.root) == [os.path.relpath(store.path(key), store.root)]
    store.verify(key)


def _process_put(root, seed, rounds, queue):
    try:
        store = SegmentStore(root)
        kv, tok, pos = make_item(T=64, seed=seed)
        keys = {store.put(kv, tok, pos, model_fingerprint=FP) for _ in range(rounds)}
        queue.put(("ok", sorted(keys)))
    except BaseException as exc:  # reported to the parent
        queue.put(("error", repr(exc)))


def test_concurrent_writers_in_processes(tmp_path):
    """Spawned processes put the same key (and one a different key) at once; a new instance then
    finds exactly the valid segments, with no temporaries left."""
    root = str(tmp_path / "store")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_process_put, args=(root, seed, 20, queue)) for seed in (8, 8, 9)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(kind == "ok" for kind, _ in results), results
    keys = sorted({k for _, ks in results for k in ks})
    assert len(keys) == 2
    fresh = SegmentStore(root)
    assert fresh.keys() == keys
    for seed in (8, 9):
        kv, tok, pos = make_item(T=64, seed=seed)
        key = fresh.put(kv, tok, pos, model_fingerprint=FP)
        assert outcome(fresh, key, kv, tok, pos) == "same"
    assert fresh.stats["writes"] == 0
    assert not [f for f in _files(root) if not f.endswith(".arrow")]


# ------------------------------------------------------------------ junk in the root
def test_keys_delete_verify_among_junk(tmp_path):
    root = tmp_path / "store"
    first = SegmentStore(root)
    items = [make_item(seed=s) for s in range(3)]
    keys = sorted(first.put(*it, model_fingerprint=FP) for it in items)
    seg_dir = root / "segments"
    shard = os.path.dirname(first.path(keys[0]))
    junk = [
        os.path.join(shard, f".{keys[0]}.arrow.123.deadbeef.tmp"),      # a crashed writer's temporary
        os.path.join(shard, f".{keys[0]}.arrow"),                        # hidden
        os.path.join(shard, f"{keys[0]}.arrow.bak"),
        os.path.join(shard, f"{keys[0].upper()}.arrow"),                 # not a key (upper case)
        os.path.join(shard, f"{keys[0][:-1]}.arrow"),                    # 63 digits
        os.path.join(shard, "zz" * 32 + ".arrow"),                       # not hex
        os.path.join(shard, "notes.txt"),
        str(seg_dir / f"{keys[1]}.arrow"),                               # outside any shard
        str(seg_dir / "abc" / f"{'ab' * 32}.arrow"),                     # 3-character "shard"
        str(seg_dir / "README"),
        str(root / "other.arrow"),
    ]
    for j in junk:
        os.makedirs(os.path.dirname(j), exist_ok=True)
        write(j, b"junk")
    os.makedirs(os.path.join(shard, "subdir"))
    os.makedirs(seg_dir / "emptyshard")
    second = SegmentStore(root)
    assert second.keys() == keys
    for key in keys:
        assert second.verify(key).key == key
    assert second.remove_temporaries() == 1
    assert not os.path.exists(junk[0]) and all(os.path.exists(j) for j in junk[1:])
    second.delete(keys[0])
    assert second.keys() == keys[1:] and keys[0] not in second
    with pytest.raises(SegmentNotFound, match=keys[0]):
        second.verify(keys[0])
    with pytest.raises(SegmentNotFound):
        second.delete(keys[0])
    for (kv, tok, pos), key in zip(items, [first.put(*it, model_fingerprint=FP) for it in items]):
        assert outcome(SegmentStore(root), key, kv, tok, pos) == "same"
