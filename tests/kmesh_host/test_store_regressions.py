"""Regressions of SegmentStore found by an adversarial audit (each failed before its fix): deep RoPE
JSON, tree parameters the reader cannot use, read errors and directories at the path, a FIFO at the
path (the open hung), a sparse file (its whole apparent size was allocated), a compressed Arrow body
(decompressed to whatever it declared), keys() listing files get() cannot find, a failed close of
the temporary closed twice, a descriptor leaked when a read's set-up failed, two API slips.
Cases that could take much memory run in subprocesses under RLIMIT_AS.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.segment_craft import craft, fp16, kv_tok_pos  # noqa: E402

import kmesh_host  # noqa: E402
from kmesh_host import KmeshError, SegmentNotFound, SegmentStore, StorageError  # noqa: E402

KMESH_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(kmesh_host.__file__)))


@pytest.fixture
def stored(tmp_path):
    store = SegmentStore(tmp_path / "store")
    kv, tok, pos = kv_tok_pos()
    key = store.put(kv, tok, pos, model_fingerprint=fp16())
    return store, key, kv, tok, pos


def _call(store, key, op, kv=None, tok=None, pos=None, check="sha256"):
    if op == "get":
        return store.get(key, model_fingerprint=fp16(), check=check)
    if op == "put":
        return store.put(kv, tok, pos, model_fingerprint=fp16())
    return getattr(store, op)(key)


def _typed(store, key, op, **kw):
    """The call either succeeds or raises a KmeshError naming the key (anything else fails)."""
    try:
        _call(store, key, op, **kw)
    except KmeshError as exc:
        assert key in str(exc), f"{op}: error does not name the segment: {exc}"


def _run_child(code: str, timeout: float, *args) -> subprocess.CompletedProcess:
    prelude = f"import sys; sys.path.insert(0, {KMESH_PARENT!r}); sys.path.insert(1, {os.path.dirname(os.path.abspath(__file__))!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("depth", [600, 100_000])
def test_deeply_nested_rope_json_is_refused_typed(stored, depth):
    """Before its fix: segment.py:476-481: json.loads / ModelFingerprint of the stored rope string raise RecursionError,
    which the `except (LayoutError, TypeError, ValueError, KeyError)` does not catch."""
    store, key, kv, tok, pos = stored
    rope = '{"a":' + "[" * depth + "]" * depth + "}"
    _, data, _ = craft(kv, tok, pos, fp16(), rope_json=rope, rekey=False)
    open(store.path(key), "wb").write(bytes(data))
    for op in ("get", "verify", "read_header", "put"):
        _typed(store, key, op, kv=kv, tok=tok, pos=pos)


@pytest.mark.parametrize("params", [dict(leaf_size=100), dict(leaf_size=4160 + 32), dict(fanout=(1 << 24) + 1)])
def test_invalid_tree_parameters_are_refused_naming_the_segment(tmp_path, params):
    """Before its fix: segment.py:495 accepts any leaf_size > 0 and fanout > 1; tree_digest then raises
    check_tree_params' IntegrityError, whose message does not name the segment."""
    store = SegmentStore(tmp_path / "store")
    kv, tok, pos = kv_tok_pos()
    key, data, _ = craft(kv, tok, pos, fp16(), root=bytes(32), **params)  # self-consistent file of `key`
    os.makedirs(os.path.dirname(store.path(key)), exist_ok=True)
    open(store.path(key), "wb").write(bytes(data))
    for op, check in (("get", "tree"), ("get", "both"), ("verify", None), ("read_header", None)):
        try:
            _call(store, key, op, check=check or "sha256")
            assert op == "read_header", f"{op} accepted a file whose tree parameters are invalid"
        except KmeshError as exc:
            assert key in str(exc), f"{op}/{check}: {exc}"


@pytest.mark.parametrize("op", ["get", "verify", "read_header", "put"])
def test_directory_at_the_segment_path_is_typed(stored, op):
    """Before its fix: store.py _open opens a directory fine (O_RDONLY); the os.preadv in _LocalRandomAccess.read_into
    then raises IsADirectoryError, which nothing converts (read_into runs outside _open's try)."""
    store, key, kv, tok, pos = stored
    os.unlink(store.path(key))
    os.mkdir(store.path(key))
    _typed(store, key, op, kv=kv, tok=tok, pos=pos)


@pytest.mark.parametrize("op", ["get", "verify", "read_header", "put"])
def test_read_io_error_is_a_storage_error(stored, monkeypatch, op):
    """Before its fix: An EIO while reading (bad sector, network filesystem) escapes as a raw OSError."""
    store, key, kv, tok, pos = stored

    def eio(*a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(StorageError, match=key):
        _call(store, key, op, kv=kv, tok=tok, pos=pos)


CHILD_FIFO = """
    import os, sys, torch
    from tests.helpers.segment_craft import fp16, kv_tok_pos
    from kmesh_host import KmeshError, SegmentStore
    st = SegmentStore(sys.argv[1]); kv, tok, pos = kv_tok_pos()
    key = st.put(kv, tok, pos, model_fingerprint=fp16())
    os.unlink(st.path(key)); os.mkfifo(st.path(key))
    op = sys.argv[2]
    try:
        if op == "get": st.get(key, model_fingerprint=fp16())
        elif op == "put": st.put(kv, tok, pos, model_fingerprint=fp16())
        else: getattr(st, op)(key)
        print("RETURNED")
    except KmeshError as e:
        print("TYPED", key in str(e))
"""


@pytest.mark.parametrize("op", ["get", "read_header", "put"])
def test_fifo_at_the_segment_path_does_not_hang(tmp_path, op):
    """Before its fix: store.py _open: os.open(path, O_RDONLY) blocks forever on a FIFO (no O_NONBLOCK, no S_ISREG check)."""
    try:
        r = _run_child(CHILD_FIFO, 20, tmp_path / "store", op)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{op} blocked for 20 s on a FIFO at the segment path")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] in (["TYPED", "True"], ["RETURNED"]), r.stdout


CHILD_SPARSE = """
    import os, resource, sys, torch
    from tests.helpers.segment_craft import fp16, kv_tok_pos
    from kmesh_host import KmeshError, SegmentStore
    st = SegmentStore(sys.argv[1]); kv, tok, pos = kv_tok_pos()
    key = st.put(kv, tok, pos, model_fingerprint=fp16())
    os.truncate(st.path(key), 1 << 40)            # the segment, then a 1 TiB hole: ~10 KiB on disk
    resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))   # without this: OOM kill
    op = sys.argv[2]
    try:
        if op == "get": st.get(key, model_fingerprint=fp16())
        elif op == "put": st.put(kv, tok, pos, model_fingerprint=fp16())
        else: getattr(st, op)(key)
        print("RESULT returned")
    except KmeshError as e:
        print("RESULT typed", key in str(e))
    except BaseException as e:
        print("RESULT untyped", type(e).__name__)
"""


@pytest.mark.parametrize("op", ["get", "verify", "read_header", "put"])
def test_sparse_file_is_refused_without_allocating_its_size(tmp_path, op):
    """Before its fix: store.py _read_verified: bytearray(size); _read_header: pa.allocate_buffer(size) and a read of
    everything after the payload; both before any check of the size. Under RLIMIT_AS: MemoryError /
    ArrowMemoryError (untyped); without it read_header was OOM-killed at 24 GB RSS."""
    r = _run_child(CHILD_SPARSE, 120, tmp_path / "store", op)
    assert r.returncode == 0, r.stderr[-2000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")][-1]
    if op == "put":
        assert line in ("RESULT returned", "RESULT typed True"), line
    else:
        assert line == "RESULT typed True", line


CHILD_BOMB = """
    import os, sys, pyarrow as pa
    from tests.helpers.segment_craft import craft, fp16, kv_tok_pos
    from kmesh_host import KmeshError, SegmentStore
    from kmesh_host.segment import encode_segment
    st = SegmentStore(sys.argv[1]); kv, tok, pos = kv_tok_pos()
    key, _ = encode_segment(kv, tok, pos, model_fingerprint=fp16())   # no put: it would read the file
    if sys.argv[2] == "make":
        st.put(kv, tok, pos, model_fingerprint=fp16())
        _, data, _ = craft(kv, tok, pos, fp16(), rekey=False, align_pad=bytes(512 << 20), meta_offset=1,
                           options=pa.ipc.IpcWriteOptions(compression="zstd"))
        open(st.path(key), "wb").write(bytes(data))
        print("SIZE", len(data))
        sys.exit(0)
    hwm = lambda: int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) >> 10
    before = hwm()
    try:
        st.get(key, model_fingerprint=fp16()); res = "returned"
    except KmeshError as e:
        res = f"typed-{key in str(e)}"
    print("RESULT", res, hwm() - before)
"""


def test_compressed_arrow_body_is_refused_before_decompressing(tmp_path):
    """Before its fix: segment.py decode_header: reader.get_batch(0) decompresses every buffer of a zstd-compressed
    body (sizes declared by the file) before any KMesh check. A ~30 KiB file costs 512 MiB here."""
    root = tmp_path / "store"
    made = _run_child(CHILD_BOMB, 120, root, "make")
    assert made.returncode == 0, made.stderr[-2000:]
    size = int(made.stdout.split()[-1])
    assert size < 200_000
    r = _run_child(CHILD_BOMB, 120, root, "read")
    assert r.returncode == 0, r.stderr[-2000:]
    _, res, grew = r.stdout.split()[-3:]
    assert res == "typed-True"
    assert int(grew) < 64, f"reading a {size}-byte file raised peak RSS by {grew} MiB"


def test_keys_lists_only_segments_the_store_can_find(stored):
    """Before its fix: store.py keys(): takes any *.arrow name in any 2-character directory, whatever the shard, and
    directories too; get()/`in` look only at <key[:2]>/<key>.arrow."""
    store, key, kv, tok, pos = stored
    seg_dir = os.path.join(store.root, "segments")
    misplaced = "cd" * 32
    os.makedirs(os.path.join(seg_dir, "zz"))
    open(os.path.join(seg_dir, "zz", misplaced + ".arrow"), "wb").write(open(store.path(key), "rb").read())
    a_dir = "ef" * 32
    os.makedirs(os.path.join(seg_dir, "ef", a_dir + ".arrow"))
    listed = store.keys()
    for k in listed:
        assert k in store, f"keys() lists {k}, which `in` says is absent"
    assert listed == [key]


def test_failed_close_of_the_temporary_is_typed_and_leaves_nothing(tmp_path, monkeypatch):
    """Before its fix: store.py _write_local: `os.close(fd); fd = -1` -- when close reports an error the handler
    closes the same fd number again (EBADF, or another thread's new file), raises that raw OSError
    and never removes the temporary."""
    store = SegmentStore(tmp_path / "store")
    kv, tok, pos = kv_tok_pos()
    real_close, closed = os.close, []

    def close_reporting_eio(fd):
        closed.append(fd)
        real_close(fd)
        if len(closed) == 1:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "close", close_reporting_eio)
    with pytest.raises(StorageError):
        store.put(kv, tok, pos, model_fingerprint=fp16())
    monkeypatch.undo()
    assert len(closed) == len(set(closed)), f"fds closed twice: {closed}"
    assert [f for d, _, fs in os.walk(store.root) for f in fs] == []


def test_no_fd_leak_when_open_fails_after_os_open(stored, monkeypatch):
    """Before its fix: store.py _open: `fd = os.open(...); return _LocalRandomAccess(fd)`; if the constructor's
    fstat/posix_fadvise raises, the fd is never closed (reported as StorageError, fd leaked)."""
    store, key, kv, tok, pos = stored

    def refuse(*a):
        raise OSError(errno.ESPIPE, "Illegal seek")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(KmeshError, match=key):
            store.get(key, model_fingerprint=fp16())
    assert len(os.listdir("/proc/self/fd")) - before == 0


def test_remove_temporaries_counts_only_what_it_removed(stored):
    """Before its fix: store.py remove_temporaries: `_remove_quietly(...); count += 1` counts failures too."""
    store, key, *_ = stored
    shard = os.path.dirname(store.path(key))
    os.makedirs(os.path.join(shard, ".not-removable.tmp"))   # unlink fails on a directory
    open(os.path.join(shard, f".{key}.arrow.1.dead.tmp"), "wb").write(b"partial")
    assert store.remove_temporaries() == 1


def test_delete_missing_ok_accepts_any_absent_key(stored):
    """Before its fix: store.py delete: self.path(key) raises SegmentNotFound for a malformed key before the
    missing_ok handling, so delete(bad_key, missing_ok=True) raises SegmentNotFound."""
    store, *_ = stored
    store.delete("not-a-key", missing_ok=True)
    with pytest.raises(SegmentNotFound):
        store.delete("not-a-key")
