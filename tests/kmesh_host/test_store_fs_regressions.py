"""Regressions of SegmentStore's pyarrow.fs path (a root that is not a plain local path), the host
tier and the in-process restorer on it, found by an audit (each failed before its fix): a FIFO at the
path hung the open, keys() listed nested files get() cannot find, a failed write on object storage
deleted another writer's segment, an interrupt left the temporary, raw OSErrors from lookups and
listings, a failed non-atomic move left a partial file under the final name, no store at a
filesystem's root, a restore report describing io_uring reads that never happened.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow.fs as pafs
import pytest
import torch

from tests.helpers.dictfs import DictFS, Fault  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kmesh_host.store as store_mod  # noqa: E402
from kmesh_host import (  # noqa: E402
    HostTier,
    HostTierConfig,
    KmeshError,
    ModelFingerprint,
    SegmentStore,
    StorageError,
)
from tests.helpers.restore import fetch  # noqa: E402

ROPE = {"base": 10000.0, "rotary_dim": 8, "is_neox_style": True}
FP = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "float16", ROPE)


def item(T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, T, 2, 8), generator=g).to(torch.float16), torch.arange(T), torch.arange(T) + 3


def fail(exc=None):
    def f(path):
        raise exc if exc is not None else Fault("injected")
    return f


def dict_store(handler=None, root="/store"):
    handler = handler or DictFS()
    return SegmentStore(root, filesystem=pafs.PyFileSystem(handler)), handler


CHILD_FIFO = """
    import os, sys, pyarrow.fs as pafs, torch
    from kmesh_host import KmeshError, ModelFingerprint, SegmentStore
    from kmesh_host.segment import encode_segment
    FP = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "float16", {"base": 10000.0, "rotary_dim": 8, "is_neox_style": True})
    kv, tok, pos = torch.zeros(2, 2, 3, 2, 8).half(), torch.arange(3), torch.arange(3)
    key = encode_segment(kv, tok, pos, model_fingerprint=FP)[0]
    base = sys.argv[1]
    st = SegmentStore("store", filesystem=pafs.SubTreeFileSystem(base, pafs.LocalFileSystem()))
    os.makedirs(os.path.join(base, "store", "segments", key[:2]))
    os.mkfifo(os.path.join(base, "store", "segments", key[:2], key + ".arrow"))
    op = sys.argv[2]
    try:
        if op == "get": st.get(key, model_fingerprint=FP)
        elif op == "put": st.put(kv, tok, pos, model_fingerprint=FP)
        else: getattr(st, op)(key)
        print("RETURNED")
    except KmeshError as e:
        print("TYPED", key in str(e))
"""


@pytest.mark.parametrize("op", ["get", "read_header", "put"])
def test_fifo_at_the_segment_path_on_a_pyarrow_filesystem_does_not_hang(tmp_path, op):
    """Before its fix: store.py _open (non-local branch): open_input_file on a FIFO blocks forever (SubTreeFileSystem
    over the local disk); the local branch was fixed with O_NONBLOCK + S_ISREG."""
    try:
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD_FIFO), str(tmp_path), op],
                           capture_output=True, text=True, timeout=10, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{op} blocked for 10 s on a FIFO at the segment path")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] in (["TYPED", "True"], ["RETURNED"]), r.stdout


@pytest.mark.parametrize("kind", ["dict", "subtree"])
def test_keys_lists_only_segments_the_store_can_find(tmp_path, kind):
    """Before its fix: store.py keys() (non-local): a recursive listing accepts <segments>/<anything>/<kk>/<kk...>.arrow
    (the parent directory only has to match the key's first two digits); get()/`in` look at
    <segments>/<kk>/<key>.arrow only, so keys() lists a key the store then cannot find."""
    if kind == "dict":
        st, _ = dict_store()
    else:
        st = SegmentStore("store", filesystem=pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem()))
    key = st.put(*item(), model_fingerprint=FP)
    with st.filesystem.open_input_file(st.path(key)) as f:
        data = f.read()
    misplaced = "cd" * 32
    path = f"{st.root}/segments/zz/cd/{misplaced}.arrow"
    st.filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with st.filesystem.open_output_stream(path) as out:
        out.write(data)
    listed = st.keys()
    for k in listed:
        assert k in st, f"keys() lists {k}, which `in` says is absent"
    assert listed == [key]


def test_failed_atomic_put_keeps_a_concurrent_writers_complete_segment(monkeypatch):
    """Before its fix: store.py _write, s3/gcs/abfs branch (reached here by adding this handler's type to
    _ATOMIC_PUT_FILESYSTEMS): the PUT goes straight to the final name and any failure deletes the
    final name -- even when a concurrent writer of the same key has just stored it completely (its
    put() returned the key). Sequence: A checks (absent); B puts (complete); A's PUT is refused
    (throttled); A deletes B's segment."""
    monkeypatch.setattr(store_mod, "_ATOMIC_PUT_FILESYSTEMS", store_mod._ATOMIC_PUT_FILESYSTEMS + ("py::dictfs",))
    a, h = dict_store()
    b = SegmentStore("/store", filesystem=pafs.PyFileSystem(DictFS(h.files, h.dirs)))
    kv, tok, pos = item(seed=1)

    def b_completes_then_a_is_throttled(path):
        h.faults.pop("open_output")
        assert b.put(kv, tok, pos, model_fingerprint=FP)
        raise Fault("open_output: SlowDown")

    h.faults["open_output"] = b_completes_then_a_is_throttled
    with pytest.raises(StorageError):
        a.put(kv, tok, pos, model_fingerprint=FP)
    key = b.keys()
    assert len(key) == 1, "the segment B stored (and reported stored) is gone"
    assert torch.equal(b.get(key[0], model_fingerprint=FP).kv, kv)


@pytest.mark.parametrize("op", ["write", "move"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupt_mid_write_removes_the_temporary(op, exc):
    """Before its fix: store.py _write (non-local): cleanup runs only for OSError/ArrowException, so a
    KeyboardInterrupt (or any other exception from the filesystem) mid-write leaves
    .<key>.arrow.<pid>.<uuid>.tmp behind; the local branch cleans up on BaseException."""
    st, h = dict_store()
    h.faults[op] = fail(exc("stop"))
    with pytest.raises((exc, KmeshError)):
        st.put(*item(seed=2), model_fingerprint=FP)
    assert sorted(h.files) == [], sorted(h.files)


def test_contains_is_typed_when_the_lookup_fails():
    """Before its fix: store.py __contains__ (non-local): get_file_info's OSError escapes raw (not a KmeshError)."""
    st, h = dict_store()
    key = st.put(*item(seed=3), model_fingerprint=FP)
    h.faults["info"] = fail()
    with pytest.raises(KmeshError, match=key):
        key in st  # noqa: B015


@pytest.mark.parametrize("op", ["keys", "remove_temporaries"])
def test_listing_failure_is_typed(op):
    """Before its fix: store.py keys()/remove_temporaries() (non-local): the listing's OSError escapes raw."""
    st, h = dict_store()
    st.put(*item(seed=4), model_fingerprint=FP)
    h.faults["list"] = fail()
    with pytest.raises(KmeshError):
        getattr(st, op)()


def test_failed_non_atomic_move_leaves_no_partial_segment():
    """Before its fix: store.py _write (non-local): only the temporary is removed after a failed move. On a filesystem
    whose move copies (pyarrow.fs does not promise atomic moves), a move failing half-way leaves a
    partial file under the final name, listed by keys() in any new instance."""
    st, h = dict_store()
    h.faults["move_mid"] = fail()
    with pytest.raises(StorageError) as info:
        st.put(*item(T=60, seed=5), model_fingerprint=FP)
    h.faults.clear()
    fresh, _ = dict_store(DictFS(h.files, h.dirs))
    assert fresh.keys() == [], f"a partial file is listed as a segment after: {info.value}"
    assert sorted(h.files) == []


def test_store_at_the_root_of_a_uri():
    """Before its fix: store.py __init__: root "" (``mock:///``, or "/" passed with a filesystem) becomes "/" and the
    directory "//segments": pyarrow's own filesystems refuse it (ArrowInvalid: Empty path component,
    not a KmeshError), so no store can live at a filesystem's root."""
    st = SegmentStore("mock:///")
    key = st.put(*item(seed=6), model_fingerprint=FP)
    assert st.keys() == [key] and torch.equal(st.get(key, model_fingerprint=FP).kv, item(seed=6)[0])
    fs = pafs._MockFileSystem()
    st2 = SegmentStore("/", filesystem=fs)
    key2 = st2.put(*item(seed=7), model_fingerprint=FP)
    assert SegmentStore("", filesystem=fs).keys() == [key2]


def test_host_staging_report_says_how_pyarrow_fs_reads_ran():
    """Before its fix: the route's report (then routes.py _finish_report): with a pyarrow.fs store every object is read by one read_at on a
    loader thread (tier._load, non-local), yet the report says "page-cache reads (O_DIRECT
    unavailable) through io_uring ..., 4 KiB chunks ..., chunked as reads land" and facts["io"]
    "every chunk of every object at once" -- none of which ran."""
    st, h = dict_store()
    keys = [st.put(*item(T=40 + i, seed=10 + i), model_fingerprint=FP) for i in range(2)]
    with HostTier(st, HostTierConfig(pin=False, verify="none", chunk_bytes=4096, read_threads=2)) as tier:
        rep = fetch(st, keys, model_fingerprint=FP, tier=tier, verify="host").report
    assert rep.tier_sources == {"read": 2}
    assert "pyarrow.fs" in rep.mechanism, rep.mechanism
    assert "KiB chunks" not in rep.mechanism and "every chunk" not in str(rep.facts.get("io")), rep.facts["io"]
