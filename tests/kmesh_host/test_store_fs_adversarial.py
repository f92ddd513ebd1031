"""SegmentStore on the pyarrow.fs path (root not a plain local path): SubTreeFileSystem over the
local disk, an fsspec in-memory filesystem through FSSpecHandler, and a dict-backed handler with
injected faults and NO atomic rename; the host tier and the in-process restorer (device "cpu") on top.

Every check asserts the store's rule: get/verify/read_header give exactly the data written or raise
a KmeshError naming the segment; a failed write leaves nothing listed by keys() (and, where its
own cleanup works, no file at all); a new instance on the same root finds every segment.
Known faults of this path (see the audit notes) are not asserted here.
"""

from __future__ import annotations

import functools
import threading
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

import kmesh_host.store as store_mod
from kmesh_host import (
    FingerprintMismatch,
    HostTier,
    HostTierConfig,
    IntegrityError,
    KmeshError,
    ModelFingerprint,
    RestoreItem,
    SegmentNotFound,
    SegmentStore,
    StorageError,
)
from tests.helpers.dictfs import DictFS, fail_with
from tests.helpers.restore import cache_for, fetch, restore_once
from tests.helpers.segment_craft import read_outcome

try:
    import fsspec  # noqa: F401
    from fsspec.implementations.memory import MemoryFileSystem
except ImportError:  # the dict handler (tests/helpers/dictfs.py) covers the same ground
    MemoryFileSystem = None

ROPE = {"base": 10000.0, "rotary_dim": 8, "is_neox_style": True}


def fp_for(dtype="float16", L=2, H=2, D=8):
    return ModelFingerprint("LlamaForCausalLM", L, H, D, dtype, ROPE)


FP = fp_for()


def make_kv(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.uint8, torch.float8_e4m3fn):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def make_item(T=9, seed=0):
    return make_kv((2, 2, T, 2, 8), torch.float16, seed), torch.arange(T) * 3 + seed, torch.arange(T) + 11


# ---------------------------------------------------------------------- backends
class Backend:
    """One pyarrow.fs filesystem holding a store root: ``store()`` opens a new instance on it (a
    restart), ``write``/``read``/``files`` touch the raw files."""

    def __init__(self, kind, tmp_path):
        self.kind = kind
        if kind == "subtree":
            self.fs, self.root = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem()), "store"
        elif kind == "fsspec-memory":
            self.root = f"/kmesh-{uuid.uuid4().hex}"
            self.fs = pafs.PyFileSystem(pafs.FSSpecHandler(MemoryFileSystem()))
        else:
            self.handler = DictFS()
            self.fs, self.root = pafs.PyFileSystem(self.handler), "/store"

    def store(self, **kw):
        if self.kind == "fsspec-memory":  # a fresh handler: only the files are shared
            return SegmentStore(self.root, filesystem=pafs.PyFileSystem(pafs.FSSpecHandler(MemoryFileSystem())), **kw)
        if self.kind == "dict":  # a new filesystem object; the handler (files, faults, hooks) is shared
            return SegmentStore(self.root, filesystem=pafs.PyFileSystem(self.handler), **kw)
        return SegmentStore(self.root, filesystem=pafs.SubTreeFileSystem(self.fs.base_path, pafs.LocalFileSystem()),
                            **kw)

    def write(self, path, data):
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(path) as out:
            out.write(bytes(data))

    def read(self, path):
        with self.fs.open_input_file(path) as f:
            return f.read()

    def files(self):
        sel = pafs.FileSelector(self.root, recursive=True, allow_not_found=True)
        return sorted(i.path for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File)

    def close(self):
        if self.kind == "fsspec-memory":
            MemoryFileSystem().rm(self.root, recursive=True)


KINDS = ["subtree", "dict",
         pytest.param("fsspec-memory", marks=pytest.mark.skipif(MemoryFileSystem is None, reason="no fsspec"))]


@pytest.fixture(params=KINDS)
def backend(request, tmp_path):
    b = Backend(request.param, tmp_path)
    yield b
    b.close()


@pytest.fixture
def dictfs(tmp_path):
    return Backend("dict", tmp_path)


def call(store, key, op, fp=FP):
    return store.get(key, model_fingerprint=fp) if op == "get" else getattr(store, op)(key)



outcome = functools.partial(read_outcome, fp=FP)  # get / verify / read_header: "same" or "refused"


# ---------------------------------------------------------------------- which path
def test_file_uri_is_the_local_fast_path_and_others_are_not(tmp_path, backend):
    uri = SegmentStore("file://" + str(tmp_path / "u"))
    assert uri.local and uri.root == str(tmp_path / "u")
    store = backend.store()
    assert not store.local and store._header_cache is None
    kv, tok, pos = make_item()
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    with pytest.raises(StorageError):
        store.local_path(key)
    assert backend.files() == [store.path(key)]  # no temporary left, one file under the final name


# ---------------------------------------------------------------------- round trips and restart
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.float8_e4m3fn]
SHAPES = [(2, 1, 1, 1, 2), (2, 3, 17, 2, 8), (2, 2, 300, 1, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_every_dtype_and_shape(backend, dtype):
    store = backend.store()
    for i, shape in enumerate(SHAPES):
        _, L, T, H, D = shape
        fp = fp_for(str(dtype).removeprefix("torch."), L, H, D)
        kv = make_kv(shape, dtype, seed=i)
        tok, pos = torch.randint(0, 50000, (T,), generator=torch.Generator().manual_seed(i)), torch.arange(T) + 1000
        key = store.put(kv, tok, pos, model_fingerprint=fp)
        for check in ("sha256", "tree", "both"):
            seg = store.get(key, model_fingerprint=fp, check=check)
            assert seg.kv.dtype == dtype and seg.kv.shape == shape
            assert torch.equal(seg.kv.view(torch.uint8), kv.view(torch.uint8))
            assert torch.equal(seg.token_ids, tok) and torch.equal(seg.positions, pos) and seg.fingerprint == fp
        assert store.verify(key).key == key and store.read_header(key).key == key
        # readable with plain pyarrow, straight from the filesystem
        table = pa.ipc.open_file(backend.fs.open_input_file(store.path(key))).read_all()
        assert table.num_rows == 1 and table.column("key")[0].as_py() == key
        assert table.column("shape")[0].as_py() == list(shape)
        assert table.column("payload")[0].as_py()[: kv.numel() * kv.element_size()] == \
            kv.contiguous().view(torch.uint8).numpy().tobytes()
        with pytest.raises(FingerprintMismatch, match=key):
            store.get(key, model_fingerprint=fp_for("float32" if dtype != torch.float32 else "float16", L, H, D))


def test_non_contiguous_input(backend):
    store = backend.store()
    kv = make_kv((2, 5, 2, 2, 8), torch.float32).transpose(1, 2)
    fp = fp_for("float32")
    key = store.put(kv, torch.arange(5), torch.arange(5), model_fingerprint=fp)
    assert torch.equal(store.get(key, model_fingerprint=fp).kv, kv)


def test_restart_finds_everything(backend):
    first = backend.store()
    items = [make_item(T=3 + s, seed=s) for s in range(5)]
    keys = sorted(first.put(*it, model_fingerprint=FP) for it in items)
    assert len(set(keys)) == 5 and first.stats["writes"] == 5
    second = backend.store()  # a new instance, new handler: nothing shared but the files
    assert second.keys() == keys and all(k in second for k in keys)
    for it in items:
        key = second.put(*it, model_fingerprint=FP)  # idempotent: found, verified, not rewritten
        assert outcome(second, key, *it) == "same"
    assert second.stats["writes"] == 0 and second.stats["puts"] == 5
    assert backend.files() == sorted(second.path(k) for k in keys)


# ---------------------------------------------------------------------- damage
def _flip(data: bytes, i: int, bit: int = 0) -> bytes:
    b = bytearray(data)
    b[i] ^= 1 << bit
    return bytes(b)


def _foreign_arrow() -> bytes:
    sink = pa.BufferOutputStream()
    table = pa.table({"a": [1, 2, 3], "payload": [b"x", b"y", b"z"]})
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def test_damaged_files_are_refused_typed(backend):
    store = backend.store()
    kv, tok, pos = make_item(T=40, seed=1)
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    other = store.put(*make_item(T=40, seed=2), model_fingerprint=FP)
    path = store.path(key)
    clean = backend.read(path)
    offset = store.read_header(key).payload_offset
    rng = torch.Generator().manual_seed(3)
    variants = {"empty": b"", "one byte": clean[:1], "magic only": clean[:8], "foreign arrow": _foreign_arrow(),
                "random": torch.randint(0, 256, (len(clean),), generator=rng, dtype=torch.uint8).numpy().tobytes(),
                "other segment": backend.read(store.path(other)), "appended": clean + b"\0" * 100}
    for cut in (4, 100, offset - 1, offset, offset + 1, len(clean) // 2, len(clean) - 1):
        variants[f"cut {cut}"] = clean[:cut]
    for i in torch.randint(0, offset, (40,), generator=rng).tolist():
        variants[f"meta flip {i}"] = _flip(clean, i, i % 8)
    payload_flips = {f"payload flip {i}": _flip(clean, i, i % 8)
                     for i in torch.randint(offset, offset + kv.numel() * 2, (8,), generator=rng).tolist()}
    for name, data in {**variants, **payload_flips}.items():
        backend.write(path, data)
        for reader in (store, backend.store()):
            results = {op: outcome(reader, key, kv, tok, pos, op=op) for op in ("get", "verify", "read_header")}
            if name in payload_flips:
                assert results["get"] == results["verify"] == "refused", name
            elif not name.startswith(("meta flip", "appended")):  # a flip in padding may be harmless
                assert set(results.values()) == {"refused"}, (name, results)
        # listed while it can be a segment file (keys()' cheap test of the head and the end);
        # damage inside is found when read, and put replaces it
        listed = key in store.keys()
        assert (key in store) == listed, name
        if not name.startswith("meta flip"):   # a flip in the schema may or may not unlist it
            assert listed == (name == "other segment" or name.startswith("payload flip")), name
    backend.write(path, clean[: len(clean) // 3])
    assert store.put(kv, tok, pos, model_fingerprint=FP) == key and store.stats["writes"] == 3
    assert outcome(backend.store(), key, kv, tok, pos, op="verify") == "same"


def test_directory_and_missing_file_are_typed(backend):
    store = backend.store()
    kv, tok, pos = make_item(seed=4)
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    store.delete(key)
    assert key not in store and store.keys() == []
    for op in ("get", "verify", "read_header"):
        with pytest.raises(SegmentNotFound, match=key):
            call(store, key, op)
    with pytest.raises(SegmentNotFound, match=key):
        store.delete(key)
    store.delete(key, missing_ok=True)
    store.delete("not-a-key", missing_ok=True)
    for bad in ("", "Z" * 64, "../" + key):
        with pytest.raises(SegmentNotFound):
            store.get(bad, model_fingerprint=FP)
        assert bad not in store
    backend.fs.create_dir(store.path(key), recursive=True)  # a directory at the segment path
    for op in ("get", "verify", "read_header"):
        assert outcome(store, key, kv, tok, pos, op=op) == "refused"
    assert store.keys() == [] and key not in store


# ---------------------------------------------------------------------- injected faults (dict handler)
WRITE_FAULTS = ["mkdir", "open_output", "write", "close", "move"]


@pytest.mark.parametrize("op", WRITE_FAULTS)
def test_write_faults_are_typed_and_leave_nothing(dictfs, op):
    store = dictfs.store()
    kv, tok, pos = make_item(seed=5)
    dictfs.handler.faults[op] = fail_with()
    with pytest.raises(StorageError) as info:
        store.put(kv, tok, pos, model_fingerprint=FP)
    dictfs.handler.faults.clear()
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    assert key in str(info.value)
    assert store.stats["writes"] == 1
    assert dictfs.files() == [store.path(key)] and store.keys() == [key]
    assert outcome(dictfs.store(), key, kv, tok, pos) == "same"


@pytest.mark.parametrize("op", WRITE_FAULTS[2:])
def test_write_fault_with_failing_cleanup_leaves_only_a_temporary(dictfs, op):
    store = dictfs.store()
    kv, tok, pos = make_item(seed=6)
    dictfs.handler.faults.update({op: fail_with(), "delete": fail_with()})
    with pytest.raises(StorageError):
        store.put(kv, tok, pos, model_fingerprint=FP)
    assert store.keys() == []  # the temporary is never a key
    assert len(dictfs.files()) == 1 and dictfs.files()[0].endswith(".tmp")
    key = dictfs.files()[0].rsplit("/", 1)[1][1:65]  # ".<key>.arrow.<pid>.<uuid>.tmp"
    with pytest.raises(SegmentNotFound, match=key):
        store.verify(key)
    assert key not in store
    dictfs.handler.faults.clear()
    assert store.remove_temporaries() == 1 and dictfs.files() == []


@pytest.mark.parametrize("op", ["open_input", "read"])
def test_read_faults_are_typed(dictfs, op):
    store = dictfs.store()
    kv, tok, pos = make_item(seed=7)
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    dictfs.handler.faults[op] = fail_with()
    for op_ in ("get", "verify", "read_header"):
        with pytest.raises(StorageError, match=key):
            call(store, key, op_)
    with pytest.raises(StorageError, match=key):  # put cannot tell whether a good copy is there
        store.put(kv, tok, pos, model_fingerprint=FP)
    dictfs.handler.faults.clear()
    assert store.stats["writes"] == 1 and outcome(store, key, kv, tok, pos, op="verify") == "same"


def test_delete_faults_are_typed(dictfs):
    store = dictfs.store()
    kv, tok, pos = make_item(seed=8)
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    for op in ("delete", "info"):
        dictfs.handler.faults[op] = fail_with()
        with pytest.raises(StorageError, match=key):
            store.delete(key)
        dictfs.handler.faults.clear()
        assert store.keys() == [key] and outcome(store, key, kv, tok, pos) == "same"
    store.delete(key)
    assert dictfs.files() == []


def test_non_oserror_from_a_read_is_not_swallowed(dictfs):
    store = dictfs.store()
    kv, tok, pos = make_item(seed=9)
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    dictfs.handler.faults["read"] = fail_with(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        store.get(key, model_fingerprint=FP)
    dictfs.handler.faults.clear()
    assert outcome(store, key, kv, tok, pos) == "same"


def test_atomic_put_branch_writes_the_final_name_directly(dictfs, monkeypatch):
    """The s3/gcs/abfs branch (no temporary name), reached by naming this handler's type."""
    monkeypatch.setattr(store_mod, "_ATOMIC_PUT_FILESYSTEMS", store_mod._ATOMIC_PUT_FILESYSTEMS + ("py::dictfs",))
    store = dictfs.store()
    kv, tok, pos = make_item(seed=10)
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    assert dictfs.handler.calls.get("move", 0) == 0 and dictfs.files() == [store.path(key)]
    store.delete(key)
    dictfs.handler.faults["write"] = fail_with()  # a failed PUT with no other writer: nothing stays
    with pytest.raises(StorageError, match=key):
        store.put(kv, tok, pos, model_fingerprint=FP)
    assert dictfs.files() == [] and store.keys() == []
    dictfs.handler.faults.clear()
    assert store.put(kv, tok, pos, model_fingerprint=FP) == key and outcome(store, key, kv, tok, pos) == "same"


# ---------------------------------------------------------------------- no atomic rename
def test_non_atomic_move_never_gives_partial_data(dictfs):
    """The dict handler's move fills the final name chunk by chunk. A reader in the middle sees a
    partial file under the final name (the store cannot hide that without an atomic rename), but it
    is refused as an IntegrityError naming the key, never returned; the finished file is exact."""
    store = dictfs.store()
    kv, tok, pos = make_item(T=200, seed=11)
    seen = []

    def reader_mid_move(dest):
        if len(seen) < 3:
            seen.append(outcome(dictfs.store(), dest.rsplit("/", 1)[1][:64], kv, tok, pos,
                                op=("get", "verify", "read_header")[len(seen)]))

    dictfs.handler.on_move_step = reader_mid_move
    dictfs.handler.move_chunk = 4096
    key = store.put(kv, tok, pos, model_fingerprint=FP)
    assert seen == ["refused"] * 3
    assert outcome(dictfs.store(), key, kv, tok, pos) == "same"


@pytest.mark.parametrize("kind", ["subtree", "dict", "fsspec-memory"])
def test_concurrent_puts_of_one_key(tmp_path, kind):
    """Threads put one key (and one other key) while readers read it: writers all get the key; a
    reader gets the exact data or SegmentNotFound -- or, on the dict handler whose move is not
    atomic, an IntegrityError naming the key; the end state is one complete file per key."""
    if kind == "fsspec-memory" and MemoryFileSystem is None:
        pytest.skip("no fsspec (the dict handler covers this)")
    backend = Backend(kind, tmp_path)
    try:
        stores = [backend.store() for _ in range(3)]
        kv, tok, pos = make_item(T=120, seed=12)
        other = make_item(T=7, seed=13)
        errors, seen = [], {"same": 0, "missing": 0, "refused": 0}
        stop = threading.Event()
        barrier = threading.Barrier(6)
        keys = set()

        def writer(store, item):
            try:
                barrier.wait(timeout=10)
                for _ in range(6):
                    keys.add(store.put(*item, model_fingerprint=FP))
            except BaseException as exc:
                errors.append(exc)

        def reader(store, key):
            try:
                barrier.wait(timeout=10)
                while not stop.is_set():
                    try:
                        call(store, key, "read_header")  # SegmentNotFound before the first rename
                        r = outcome(store, key, kv, tok, pos)
                        if r == "refused":
                            assert kind == "dict", "a complete-or-nothing filesystem showed a bad file"
                        seen[r] += 1
                    except SegmentNotFound:
                        seen["missing"] += 1
            except BaseException as exc:
                errors.append(exc)

        from kmesh_host.segment import encode_segment
        key = encode_segment(kv, tok, pos, model_fingerprint=FP)[0]
        threads = [threading.Thread(target=writer, args=(s, (kv, tok, pos))) for s in stores] + \
                  [threading.Thread(target=writer, args=(stores[0], other))] + \
                  [threading.Thread(target=reader, args=(backend.store(), key)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads[:4]:
            t.join(timeout=60)
        stop.set()
        for t in threads[4:]:
            t.join(timeout=60)
        assert not errors, errors
        assert seen["same"] + seen["missing"] + seen["refused"] > 0
        fresh = backend.store()
        assert keys == set(fresh.keys()) and key in keys and len(keys) == 2
        assert backend.files() == sorted(fresh.path(k) for k in keys)  # no temporaries
        assert outcome(fresh, key, kv, tok, pos, op="verify") == "same"
        assert outcome(fresh, fresh.put(*other, model_fingerprint=FP), *other) == "same"
    finally:
        backend.close()


# ---------------------------------------------------------------------- junk in the root
def test_keys_delete_verify_remove_temporaries_among_junk(backend):
    first = backend.store()
    items = [make_item(seed=s) for s in range(3)]
    keys = sorted(first.put(*it, model_fingerprint=FP) for it in items)
    seg = f"{first.root}/segments"
    shard = first.path(keys[0]).rsplit("/", 1)[0]
    junk = [
        f"{shard}/.{keys[0]}.arrow.123.deadbeef.tmp",   # a crashed writer's temporary
        f"{shard}/.{keys[0]}.arrow",
        f"{shard}/{keys[0]}.arrow.bak",
        f"{shard}/{keys[0].upper()}.arrow",
        f"{shard}/{keys[0][:-1]}.arrow",
        f"{shard}/{'zz' * 32}.arrow",
        f"{shard}/notes.txt",
        f"{seg}/{keys[1]}.arrow",                        # outside any shard
        f"{seg}/abc/{'ab' * 32}.arrow",                  # 3-character shard
        f"{seg}/README",
        f"{first.root}/other.arrow",
    ]
    for j in junk:
        backend.write(j, b"junk")
    backend.fs.create_dir(f"{seg}/{'ef' * 1}/{'ef' * 32}.arrow", recursive=True)  # a directory named like a segment
    second = backend.store()
    assert second.keys() == keys and "ef" * 32 not in second
    for key, it in zip(keys, sorted(items, key=lambda it: first.put(*it, model_fingerprint=FP))):
        assert second.verify(key).key == key
    assert second.remove_temporaries() == 1
    left = backend.files()
    assert junk[0] not in left and all(j in left for j in junk[1:])
    second.delete(keys[0])
    assert second.keys() == keys[1:] and keys[0] not in second
    with pytest.raises(SegmentNotFound, match=keys[0]):
        second.verify(keys[0])
    for it in items:
        key = first.put(*it, model_fingerprint=FP)
        assert outcome(backend.store(), key, *it) == "same"


# ---------------------------------------------------------------------- host tier and routes on device "cpu"
TOKENS = [37, 64, 100]


@pytest.fixture
def segments(dictfs):
    store = dictfs.store()
    out = []
    for i, T in enumerate(TOKENS):
        kv = make_kv((2, 2, T, 2, 8), torch.float16, seed=20 + i)
        pos = torch.arange(T) + 5 * i
        out.append((store.put(kv, torch.arange(T), pos, model_fingerprint=FP), kv, pos))
    return store, out


def _tier(store, **kw):
    kw.setdefault("verify", "none")
    return HostTier(store, HostTierConfig(pin=False, chunk_bytes=4096, read_threads=2, **kw))


@pytest.mark.parametrize("verify", ["sha256", "tree", "none"])
def test_tier_acquire_is_bit_exact_and_single_flight(segments, verify):
    store, segs = segments
    with _tier(store, verify=verify) as tier:
        leases = []
        barrier = threading.Barrier(4)
        errors = []

        def take(key):
            try:
                barrier.wait(timeout=10)
                leases.append(tier.acquire(key, model_fingerprint=FP))
            except BaseException as exc:
                errors.append(exc)

        for key, kv, pos in segs:
            leases.clear()
            threads = [threading.Thread(target=take, args=(key,)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            assert not errors, errors
            assert sorted(le.source for le in leases).count("read") == 1
            for le in leases:
                assert torch.equal(le.kv.view(torch.uint8), kv.view(torch.uint8))
                assert le.o_direct is False and "pyarrow.fs" in le.io_note
                assert (le.verified is not None) == (verify != "none")
                le.release()
        assert tier.reads_by_key == {k: 1 for k, _, _ in segs}
        assert sorted(tier.resident()) == sorted(k for k, _, _ in segs)
        tier.evict()
        assert tier.pool.in_use_bytes == 0


def test_tier_failures_are_typed_and_release_their_buffers(segments, dictfs):
    store, segs = segments
    (k0, kv0, _), (k1, _, _), (k2, _, _) = segs
    p1 = store.path(k1)
    data = dictfs.handler.files[p1]
    data[len(data) - 5000] ^= 0x10  # inside the payload (payload then a short footer)
    with _tier(store, verify="sha256") as tier:
        with pytest.raises(IntegrityError, match=k1):
            tier.acquire(k1, model_fingerprint=FP)
        assert k1 not in tier and tier.stats["failures"] == 1
        with pytest.raises(SegmentNotFound, match="ab" * 32):
            tier.acquire("ab" * 32, model_fingerprint=FP)
        with pytest.raises(FingerprintMismatch, match=k0):
            tier.acquire(k0, model_fingerprint=fp_for("bfloat16"))
        dictfs.handler.faults["read"] = fail_with()
        with pytest.raises(StorageError, match=k2):
            tier.acquire(k2, model_fingerprint=FP)
        dictfs.handler.faults.clear()
        opens = []

        def truncate_on_second_open(path):  # the file shrinks between the header and the payload read
            opens.append(path)
            if len(opens) == 2:
                del dictfs.handler.files[path][-6000:]

        dictfs.handler.faults["open_input"] = truncate_on_second_open
        with pytest.raises(KmeshError, match=k0):
            tier.acquire(k0, model_fingerprint=FP)
        dictfs.handler.faults.clear()
        assert tier.resident() == [] and tier.pool.in_use_bytes == 0
        with tier.acquire(k2, model_fingerprint=FP) as lease:
            assert lease.source == "read"


def _keys(segs):
    return [k for k, _, _ in segs]


@pytest.mark.parametrize("verify", ["device", "device-batched", "host", "none"])
def test_host_staging_cpu_is_bit_exact(segments, verify):
    store, segs = segments
    with _tier(store) as tier:
        for round_ in range(2):  # a read, then hits from the retained tier
            result = fetch(store, _keys(segs), model_fingerprint=FP, tier=tier, verify=verify)
            rep = result.report
            assert rep.objects == 3 and rep.tier_sources == ({"read": 3} if round_ == 0 else {"hit": 3})
            for (key, kv, pos), got, seg in zip(segs, result.kv, result.segments()):
                assert got.device.type == "cpu" and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
                assert seg.key == key and torch.equal(seg.positions, pos)
        assert tier.reads_by_key == {k: 1 for k, _, _ in segs}
        tier.evict()
        assert tier.pool.in_use_bytes == 0
    # a private tier (no tier passed)
    result = fetch(store, _keys(segs), model_fingerprint=FP, verify=verify)
    assert all(torch.equal(g.view(torch.uint8), kv.view(torch.uint8)) for g, (_, kv, _) in zip(result.kv, segs))


def test_host_staging_cpu_concurrent_restores_read_each_key_once(segments, dictfs):
    store, segs = segments
    gate = threading.Event()
    children = [cache_for(store, _keys(segs)) for _ in range(3)]  # (each child's cache and items, made first)
    dictfs.handler.faults["open_input"] = lambda path: gate.wait(5)
    results, errors = [], []
    with _tier(store) as tier:
        def run(layout, cache, items):
            try:
                results.append(restore_once(store, items, cache=cache, layout=layout, model_fingerprint=FP, tier=tier,
                                            verify="host"))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=child) for child in children]
        for t in threads:
            t.start()
        threading.Timer(0.3, gate.set).start()
        for t in threads:
            t.join(timeout=60)
        dictfs.handler.faults.clear()
        assert not errors, errors and len(results) == 3
        assert tier.reads_by_key == {k: 1 for k, _, _ in segs}
        assert sum(r.report.tier_sources.get("read", 0) for r in results) == 3
        for r in results:
            assert all(torch.equal(g.view(torch.uint8), kv.view(torch.uint8)) for g, (_, kv, _) in zip(r.kv, segs))
        tier.evict()
        assert tier.pool.in_use_bytes == 0


@pytest.mark.parametrize("verify", ["device", "host"])
def test_host_staging_cpu_failures_are_typed(segments, dictfs, verify):
    store, segs = segments
    k1 = segs[1][0]
    data = dictfs.handler.files[store.path(k1)]
    data[len(data) - 5000] ^= 0x01
    layout, cache, items = cache_for(store, _keys(segs))

    def restore(its):
        return restore_once(store, its, cache=cache, layout=layout, model_fingerprint=FP, tier=tier, verify=verify)

    with _tier(store) as tier:
        with pytest.raises(IntegrityError, match=k1):
            restore(items)
        assert k1 not in tier
        tier.evict()
        assert tier.pool.in_use_bytes == 0
        data[len(data) - 5000] ^= 0x01  # repaired: the next restore reads it again and succeeds
        result = restore(items)
        assert torch.equal(result.kv[1].view(torch.uint8), segs[1][1].view(torch.uint8))
        missing = "cd" * 32
        with pytest.raises(SegmentNotFound, match=missing):
            restore(items + [RestoreItem(missing, torch.arange(1))])
        tier.evict()
        dictfs.handler.faults["read"] = fail_with()
        with pytest.raises(StorageError, match=segs[0][0]):
            restore(items)
        dictfs.handler.faults.clear()
        tier.evict()
        assert tier.pool.in_use_bytes == 0 and tier.resident() == []
