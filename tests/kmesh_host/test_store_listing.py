"""SegmentStore's listing and lookups under hostile and clumsy roots (issue "cache service under
hostile and clumsy clients", item 6): every failure of keys(), remove_temporaries(), `in`, delete()
and the constructor is a StorageError naming the path and the OS error, and keys() / `in` name only
files that look like segment files -- a regular file <key[:2]>/<key>.arrow of at least MIN_FILE_SIZE
bytes, the Arrow magic at both ends, "kmesh-segment" in its first 4 KiB -- never junk that merely
has a key's name.

Tests run as root, where mode bits do not stop reads: unreadable directories and files are made by
making os.scandir / os.lstat / os.open / os.pread (local root) or the pyarrow.fs handler (dict root)
raise PermissionError for exactly one path.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from kmesh_host import KmeshError, ModelFingerprint, SegmentNotFound, SegmentStore, StorageError
from tests.helpers.dictfs import DictFS

ROPE = {"base": 10000.0, "rotary_dim": 8, "is_neox_style": True}
FP = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "float16", ROPE)


def make_item(T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, T, 2, 8), generator=g).to(torch.float16), torch.arange(T) * 3 + seed, torch.arange(T) + 11


@pytest.fixture
def stored(tmp_path):
    """A local store holding two segments: ``(store, key, other)``; ``key``'s file is the one abused."""
    store = SegmentStore(tmp_path / "store")
    key = store.put(*make_item(seed=0), model_fingerprint=FP)
    other = store.put(*make_item(seed=1), model_fingerprint=FP)
    return store, key, other


def _refuse(monkeypatch, name: str, path: str, exc=None):
    """Make ``os.<name>`` fail for ``path`` only (PermissionError unless ``exc``)."""
    real = getattr(os, name)
    path = os.fspath(path)

    def refusing(p, *a, **k):
        if not isinstance(p, int) and os.fspath(p) == path:
            raise exc if exc is not None else PermissionError(errno.EACCES, "Permission denied", path)
        return real(p, *a, **k)

    monkeypatch.setattr(os, name, refusing)


def _raises_naming(fn, *parts):
    with pytest.raises(StorageError) as info:
        fn()
    for part in parts:
        assert part in str(info.value), f"{info.value!r} does not name {part!r}"


def _foreign_arrow(big=False) -> bytes:
    sink = pa.BufferOutputStream()
    table = pa.table({"a": [1, 2, 3], "b": [bytes(8192 if big else 1)] * 3})
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _within(seconds, fn, fifo=None):
    """``fn()`` on a thread; fails the test if it does not return within ``seconds`` (a FIFO's open
    would block: ``fifo`` is then opened for writing, which releases it)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised below
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"blocked for {seconds} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---------------------------------------------------------------------- local root: unreadable parts
def test_unreadable_segments_directory_is_a_storage_error(stored, monkeypatch):
    store, key, _ = stored
    seg_dir = os.path.join(store.root, "segments")
    _refuse(monkeypatch, "scandir", seg_dir)
    for op in (store.keys, store.remove_temporaries):
        _raises_naming(op, seg_dir, "Permission denied")


def test_unreadable_shard_is_a_storage_error(stored, monkeypatch):
    store, key, _ = stored
    shard = os.path.dirname(store.path(key))
    _refuse(monkeypatch, "scandir", shard)
    for op in (store.keys, store.remove_temporaries):
        _raises_naming(op, shard, "Permission denied")
    # a shard without search permission: the file in it cannot even be looked up
    _refuse(monkeypatch, "lstat", store.path(key))
    _raises_naming(lambda: key in store, store.path(key), "Permission denied")
    _refuse(monkeypatch, "unlink", store.path(key))
    _raises_naming(lambda: store.delete(key), store.path(key), "Permission denied")


@pytest.mark.parametrize("how", ["open", "read"])
def test_unreadable_segment_file_is_a_storage_error(stored, monkeypatch, how):
    """keys() reads 6 bytes at each end of every candidate: a file it cannot read is reported, not
    silently listed (nor silently dropped)."""
    store, key, _ = stored
    path = store.path(key)
    if how == "open":
        _refuse(monkeypatch, "open", path)
    else:
        real = os.pread

        def eio(fd, n, off):
            if os.path.realpath(f"/proc/self/fd/{fd}") == path:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, n, off)

        monkeypatch.setattr(os, "pread", eio)
    why = "Permission denied" if how == "open" else "Input/output error"
    _raises_naming(store.keys, path, why)
    _raises_naming(lambda: key in store, path, why)


def test_missing_segments_directory_lists_nothing(stored):
    store, key, other = stored
    shutil.rmtree(os.path.join(store.root, "segments"))
    assert store.keys() == [] and store.remove_temporaries() == 0 and key not in store
    with pytest.raises(SegmentNotFound, match=key):
        store.delete(key)
    assert store.put(*make_item(seed=0), model_fingerprint=FP) == key and store.keys() == [key]


def test_segments_directory_replaced_by_a_file(stored):
    store, key, _ = stored
    seg_dir = os.path.join(store.root, "segments")
    shutil.rmtree(seg_dir)
    open(seg_dir, "wb").write(b"junk")
    for op in (store.keys, store.remove_temporaries):
        _raises_naming(op, seg_dir)
    assert key not in store
    with pytest.raises(SegmentNotFound, match=key):
        store.delete(key)
    _raises_naming(lambda: SegmentStore(store.root), seg_dir)


def test_uncreatable_root_is_a_storage_error(tmp_path, monkeypatch):
    root = tmp_path / "store"

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(root))

    monkeypatch.setattr(os, "makedirs", refuse)
    _raises_naming(lambda: SegmentStore(root), str(root), "Permission denied")


# ---------------------------------------------------------------------- local root: junk with a key's name
def _place_local(kind, path, clean, tmp_path):
    """Put junk of ``kind`` at ``path`` (the segment file there is removed first)."""
    os.unlink(path)
    if kind == "empty":
        open(path, "wb").close()
    elif kind == "random":
        open(path, "wb").write(torch.randint(0, 256, (len(clean),), generator=torch.Generator().manual_seed(5),
                                             dtype=torch.uint8).numpy().tobytes())
    elif kind in ("foreign-arrow", "foreign-arrow-big"):
        open(path, "wb").write(_foreign_arrow(kind.endswith("big")))
    elif kind == "framed-zeros":   # the magic at both ends, nothing between
        open(path, "wb").write(b"ARROW1" + bytes(len(clean) - 12) + b"ARROW1")
    elif kind == "truncated":
        open(path, "wb").write(clean[:-1])
    elif kind == "symlink-to-segment":   # a valid segment elsewhere: the store never makes links
        elsewhere = tmp_path / "elsewhere.arrow"
        elsewhere.write_bytes(clean)
        os.symlink(elsewhere, path)
    elif kind == "symlink-to-dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "symlink-dangling":
        os.symlink(tmp_path / "nowhere", path)
    elif kind == "symlink-loop":
        os.symlink(path, path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        raise AssertionError(kind)


LOCAL_JUNK = ["empty", "random", "foreign-arrow", "foreign-arrow-big", "framed-zeros", "truncated",
              "symlink-to-segment", "symlink-to-dev-zero", "symlink-dangling", "symlink-loop", "directory", "fifo"]


@pytest.mark.parametrize("kind", LOCAL_JUNK)
def test_junk_named_like_a_key_is_not_listed(stored, tmp_path, kind):
    store, key, other = stored
    path = store.path(key)
    clean = open(path, "rb").read()
    _place_local(kind, path, clean, tmp_path)
    for st in (store, SegmentStore(store.root)):
        assert _within(20, st.keys, fifo=path if kind == "fifo" else None) == [other]
        assert not _within(20, lambda: key in st, fifo=path if kind == "fifo" else None)
        assert other in st
    assert store.remove_temporaries() == 0 and os.path.lexists(path)   # junk, not a temporary: left
    if kind == "directory":
        with pytest.raises(SegmentNotFound, match=key):
            store.delete(key)
        os.rmdir(path)
    else:
        store.delete(key)            # delete removes whatever is under the name (not a link's target)
        assert not os.path.lexists(path)
    assert store.put(*make_item(seed=0), model_fingerprint=FP) == key
    assert store.keys() == sorted([key, other]) and key in store


def test_a_damaged_segment_is_still_listed(stored):
    """The cheap test is not verification: a payload flip keeps the file listed (verify finds it)."""
    store, key, other = stored
    path = store.path(key)
    data = bytearray(open(path, "rb").read())
    data[store.read_header(key).payload_offset] ^= 1
    open(path, "wb").write(bytes(data))
    assert store.keys() == sorted([key, other]) and key in store
    with pytest.raises(KmeshError, match=key):
        store.verify(key)


def test_a_symlinked_shard_directory_is_not_listed(stored, tmp_path):
    store, key, other = stored
    shard = os.path.dirname(store.path(key))
    moved = tmp_path / "moved-shard"
    shutil.move(shard, moved)
    os.symlink(moved, shard)
    assert store.keys() == [k for k in [other] if k[:2] != key[:2]]
    assert store.remove_temporaries() == 0
    open(moved / f".{key}.arrow.1.dead.tmp", "wb").write(b"x")
    assert store.remove_temporaries() == 0 and (moved / f".{key}.arrow.1.dead.tmp").exists()  # never followed


# ---------------------------------------------------------------------- pyarrow.fs roots
class _Root:
    """A store root on a pyarrow.fs filesystem: ``subtree`` (the local disk seen through
    SubTreeFileSystem: FIFOs and links exist) or ``dict`` (tests/helpers/dictfs.py, with faults)."""

    def __init__(self, kind, tmp_path):
        self.kind, self.tmp_path = kind, tmp_path
        self.handler = DictFS() if kind == "dict" else None

    def store(self):
        if self.kind == "dict":
            return SegmentStore("/store", filesystem=pafs.PyFileSystem(self.handler))
        return SegmentStore("store", filesystem=pafs.SubTreeFileSystem(str(self.tmp_path), pafs.LocalFileSystem()))

    def os_path(self, path):
        return os.path.join(self.tmp_path, path)


@pytest.fixture(params=["subtree", "dict"])
def root(request, tmp_path):
    return _Root(request.param, tmp_path)


FS_JUNK = ["empty", "random", "foreign-arrow", "foreign-arrow-big", "framed-zeros", "truncated", "directory"]
SUBTREE_JUNK = ["fifo", "symlink-to-dev-zero", "symlink-dangling"]


@pytest.mark.parametrize("kind", FS_JUNK + SUBTREE_JUNK)
def test_junk_named_like_a_key_is_not_listed_on_a_pyarrow_filesystem(root, tmp_path, kind):
    if kind in SUBTREE_JUNK and root.kind != "subtree":
        pytest.skip("the dict filesystem has no FIFOs or links")
    store = root.store()
    key = store.put(*make_item(seed=0), model_fingerprint=FP)
    other = store.put(*make_item(seed=1), model_fingerprint=FP)
    path, fs = store.path(key), store.filesystem
    with fs.open_input_file(path) as f:
        clean = f.read()
    if kind in SUBTREE_JUNK or (kind == "directory" and root.kind == "subtree"):
        _place_local(kind, root.os_path(path), clean, tmp_path)
    else:
        fs.delete_file(path)
        if kind == "directory":
            fs.create_dir(path, recursive=True)
        else:
            data = {"empty": b"", "random": bytes(range(256)) * (len(clean) // 256 + 1),
                    "foreign-arrow": _foreign_arrow(), "foreign-arrow-big": _foreign_arrow(big=True),
                    "framed-zeros": b"ARROW1" + bytes(len(clean) - 12) + b"ARROW1", "truncated": clean[:-1]}[kind]
            with fs.open_output_stream(path) as out:
                out.write(data)
    fifo = root.os_path(path) if kind == "fifo" else None
    for st in (store, root.store()):
        assert _within(20, st.keys, fifo=fifo) == [other]
        assert not _within(20, lambda: key in st, fifo=fifo) and other in st


def test_pyarrow_filesystem_failures_are_storage_errors(tmp_path):
    """Unreadable listing, candidate file, lookup and root on the dict filesystem."""
    handler = DictFS()
    store = SegmentStore("/store", filesystem=pafs.PyFileSystem(handler))
    key = store.put(*make_item(seed=0), model_fingerprint=FP)
    path, shard = store.path(key), store.path(key).rsplit("/", 1)[0]

    def refuse(p):
        raise PermissionError(errno.EACCES, "Permission denied", p)

    handler.faults["list"] = lambda p: refuse(shard)   # a recursive listing fails as a whole
    for op in (store.keys, store.remove_temporaries):
        _raises_naming(op, shard, "Permission denied")
    handler.faults = {"open_input": refuse}
    _raises_naming(store.keys, path, "Permission denied")
    _raises_naming(lambda: key in store, path, "Permission denied")
    handler.faults = {"info": refuse}
    _raises_naming(lambda: key in store, path, "Permission denied")
    _raises_naming(lambda: store.delete(key), path, "Permission denied")
    handler.faults = {"mkdir": refuse}
    _raises_naming(lambda: SegmentStore("/other", filesystem=pafs.PyFileSystem(handler)), "/other/segments",
                   "Permission denied")
    handler.faults = {}
    handler.dirs.difference_update({d for d in handler.dirs if d.startswith("/store/segments")})
    handler.files.clear()
    assert store.keys() == [] and store.remove_temporaries() == 0 and key not in store
