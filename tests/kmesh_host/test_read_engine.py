"""The O_DIRECT read engines: io_uring (kmesh_host.uring) and the thread pool give the same bytes
for every alignment edge; io_uring's errors, retries, short files, backlog and shutdown."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

from kmesh_gpu.errors import IntegrityError, StorageError
from kmesh_host import uring
from kmesh_host.direct_io import ALIGN, DirectFile, HostBuffer, ReadEngine, round_up

HAVE_URING, WHY = uring.available()
ENGINES = ["threads", "io_uring"] if HAVE_URING else ["threads"]


def _file_maker(directory):
    def make(size: int, name: str = "f.bin") -> tuple[str, bytes]:
        path = str(directory / name)
        data = os.urandom(size)
        with open(path, "wb") as f:
            f.write(data)
        return path, data
    return make


@pytest.fixture
def data_file(tmp_path):
    return _file_maker(tmp_path)


@pytest.fixture
def direct_file(direct_dir):
    """``data_file`` where the filesystem takes O_DIRECT reads (the tests that check reads bypass the page cache)."""
    return _file_maker(direct_dir)


def test_auto_picks_io_uring_where_available_and_says_why_not():
    with ReadEngine(2, 8192) as engine:
        assert engine.engine == ("io_uring" if HAVE_URING else "threads")
        assert engine.description.startswith("io_uring" if HAVE_URING else "os.preadv")  # (the note names io_uring)
        if not HAVE_URING:
            assert engine.engine_note == WHY and WHY


def test_io_uring_required_but_unavailable_is_a_typed_error(monkeypatch):
    monkeypatch.setattr(uring, "available", lambda: (False, "io_uring unavailable: test"))
    with pytest.raises(StorageError, match="io_uring requested but not usable here: io_uring unavailable: test"):
        ReadEngine(2, 8192, engine="io_uring")
    with ReadEngine(2, 8192) as engine:  # auto falls back and says why
        assert engine.engine == "threads" and engine.engine_note == "io_uring unavailable: test"
    with pytest.raises(ValueError, match="engine"):
        ReadEngine(2, 8192, engine="aio")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("size,offset,length,chunk", [
    (9000, 0, 9000, 4096),  # file end inside the last chunk
    (3 * ALIGN, 0, 3 * ALIGN, 4096),  # exact multiple
    (50_000, 5000, 30_001, 8192),  # unaligned start and length
    (50_000, 4095, 1, 4096),  # one byte at a page edge
    (1 << 20, 123_456, (1 << 20) - 123_456, 65536),  # to the end of the file
])
def test_engines_read_exact_bytes(direct_file, engine, size, offset, length, chunk):
    path, data = direct_file(size)
    with DirectFile(path) as f, ReadEngine(3, chunk, engine=engine) as reader, \
            HostBuffer(round_up(offset % ALIGN + length)) as buf:
        assert f.o_direct
        got = bytes(reader.read(f, offset, length, buf.view))
        assert got == data[offset:offset + length]
        # the callback form: every chunk once, inside the requested bytes
        seen, done = [], threading.Event()
        lead = offset % ALIGN
        expect = len(range(0, round_up(lead + length), chunk))

        def on_chunk(lo, hi, error):
            seen.append((lo, hi, error))
            if len(seen) == expect:
                done.set()

        buf.view[:] = b"\0" * len(buf.view)
        assert reader.start(f, offset, length, buf.view, on_chunk) == expect
        assert done.wait(30)
        assert all(e is None and lead <= lo <= hi <= lead + length for lo, hi, e in seen)
        assert bytes(buf.view[lead:lead + length]) == data[offset:offset + length]


@pytest.mark.parametrize("engine", ENGINES)
def test_truncated_file_is_an_integrity_error(data_file, engine):
    path, data = data_file(10_000)
    with DirectFile(path) as f, ReadEngine(2, 4096, engine=engine) as reader, HostBuffer(32768) as buf:
        with pytest.raises(IntegrityError, match="truncated"):
            reader.read(f, 0, 20_000, buf.view, name="seg-x")
        errors, done = [], threading.Event()

        def on_chunk(lo, hi, error):
            errors.append(error)
            if len(errors) == 5:
                done.set()

        reader.start(f, 0, 20_000, buf.view, on_chunk, name="seg-x")
        assert done.wait(30)
        assert sum(isinstance(e, IntegrityError) for e in errors) >= 1


@pytest.mark.skipif(not HAVE_URING, reason=f"io_uring not available here: {WHY}")
def test_io_uring_kernel_error_is_retried_synchronously(direct_file, monkeypatch):
    """A read the kernel refuses (here: a misaligned O_DIRECT address, EINVAL) is redone with the
    thread pool's read, which gives the bytes; a failing retry reports its StorageError."""
    path, data = direct_file(5 * ALIGN)
    real = ReadEngine._read
    calls = []

    def misaligned(self, file, buffer, base, a, b, file_offset, done, after=None):
        calls.append(a)
        return real(self, file, buffer, base + 1 if a == 0 else base, a, b, file_offset, done, after)

    monkeypatch.setattr(ReadEngine, "_read", misaligned)
    retries = []
    real_pread = DirectFile.pread_into

    def counted(self, view, offset):
        retries.append(offset)
        return real_pread(self, view, offset)

    monkeypatch.setattr(DirectFile, "pread_into", counted)
    with DirectFile(path) as f, ReadEngine(2, ALIGN, engine="io_uring") as reader, HostBuffer(5 * ALIGN) as buf:
        assert bytes(reader.read(f, 0, 5 * ALIGN, buf.view)) == data
        assert retries == [0] and f.o_direct  # only the refused chunk, and O_DIRECT stays on

    def failing(self, view, offset):
        raise StorageError(f"read of {self.path} at {offset} failed: injected")

    monkeypatch.setattr(DirectFile, "pread_into", failing)
    with DirectFile(path) as f, ReadEngine(2, ALIGN, engine="io_uring") as reader, HostBuffer(5 * ALIGN) as buf:
        with pytest.raises(StorageError, match="injected"):
            reader.read(f, 0, 5 * ALIGN, buf.view)


@pytest.mark.skipif(not HAVE_URING, reason=f"io_uring not available here: {WHY}")
def test_io_uring_backlog_beyond_depth_and_close_waits(data_file):
    """More reads than the depth wait their turn; close() returns only after every read landed."""
    path, data = data_file(64 * ALIGN)
    with DirectFile(path) as f, HostBuffer(64 * ALIGN) as buf:
        reader = uring.UringReader(depth=2)
        landed = []
        for i in range(64):
            reader.read(f.fileno(), buf.address + i * ALIGN, ALIGN, i * ALIGN,
                        lambda n, e, i=i: landed.append((i, n, e)), size=f.size)
        reader.close()  # waits for all 64
        assert sorted(i for i, _, _ in landed) == list(range(64))
        assert all(n == ALIGN and e is None for _, n, e in landed)
        assert bytes(buf.view) == data
        with pytest.raises(RuntimeError, match="closed"):
            reader.read(f.fileno(), buf.address, ALIGN, 0, lambda n, e: None)


@pytest.mark.skipif(not HAVE_URING, reason=f"io_uring not available here: {WHY}")
def test_io_uring_callback_failure_does_not_stop_the_reader(data_file):
    path, data = data_file(4 * ALIGN)
    with DirectFile(path) as f, HostBuffer(4 * ALIGN) as buf, uring.UringReader(depth=4) as reader:
        ok = threading.Event()

        def bad(n, e):
            raise ValueError("callback bug")

        reader.read(f.fileno(), buf.address, ALIGN, 0, bad, size=f.size)
        reader.read(f.fileno(), buf.address + ALIGN, ALIGN, ALIGN, lambda n, e: ok.set(), size=f.size)
        assert ok.wait(30)
    assert any(isinstance(e, ValueError) for e in reader.callback_errors)


@pytest.mark.skipif(not HAVE_URING, reason=f"io_uring not available here: {WHY}")
def test_ring_nop_and_read_round_trip(data_file):
    path, data = data_file(ALIGN)
    ring = uring.Ring(8)
    try:
        out = ctypes.create_string_buffer(100)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert ring.space() == ring.sq_entries
            ring.put(uring.OP_NOP, 0, 0, 0, 0, 7)
            ring.put(uring.OP_READ, fd, 10, ctypes.addressof(out), 100, 8)
            assert ring.submit() == 2
            got = ring.collect(2)
        finally:
            os.close(fd)
        assert got == {7: 0, 8: 100} and out.raw == data[10:110]
    finally:
        ring.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_after_hook_follows_each_group_of_chunk_callbacks(data_file, engine):
    """``ReadEngine.start(after=)``: on the thread pool ``after`` runs right after each chunk's
    callback; with io_uring once per wake-up of the completion thread, after every callback that
    wake-up ran (each distinct hook once). Either way every callback is followed by an ``after`` on
    its thread, none runs before the first callback, and a range without the hook runs none."""
    path, data = data_file(20 * 4096)
    log, lock, done = [], threading.Lock(), threading.Semaphore(0)
    with DirectFile(path) as f, DirectFile(path) as g, ReadEngine(8, 4096, engine=engine) as reader, \
            HostBuffer(20 * 4096) as buf, HostBuffer(20 * 4096) as other:
        def chunk(lo, hi, err):
            assert err is None
            with lock:
                log.append(("chunk", threading.get_ident()))
            done.release()

        def after():
            with lock:
                log.append(("after", threading.get_ident()))

        n = reader.start(f, 0, 20 * 4096, buf.view, chunk, after=after)
        m = reader.start(g, 0, 20 * 4096, other.view, lambda lo, hi, err: done.release())  # no hook
        for _ in range(n + m):
            done.acquire()
        reader.close()  # every callback and hook has run
        assert bytes(buf.view[:20 * 4096]) == data
    chunks = [e for e in log if e[0] == "chunk"]
    afters = [e for e in log if e[0] == "after"]
    assert len(chunks) == n == 20 and log[0][0] == "chunk" and log[-1][0] == "after"
    if engine == "threads":
        assert len(afters) == n
    else:
        assert 1 <= len(afters) <= n
    for i, (kind, thread) in enumerate(log):  # each callback's thread runs an `after` later on
        if kind == "chunk":
            assert ("after", thread) in log[i + 1:]


@pytest.mark.skipif(not HAVE_URING, reason=f"io_uring not available here: {WHY}")
def test_io_uring_after_hook_failure_does_not_stop_the_reader(data_file):
    """An ``after`` hook that raises is recorded like a failing callback; later reads, their
    callbacks and their hooks still run."""
    path, data = data_file(4 * ALIGN)
    with DirectFile(path) as f, HostBuffer(4 * ALIGN) as buf, uring.UringReader(depth=4) as reader:
        ran, ok = [], threading.Event()

        def bad_hook():
            raise ValueError("hook bug")

        reader.read(f.fileno(), buf.address, ALIGN, 0, lambda n, e: ran.append(n), size=f.size, after=bad_hook)
        for _ in range(100):  # let the first read and its hook go by on their own wake-up
            if reader.callback_errors:
                break
            threading.Event().wait(0.01)
        reader.read(f.fileno(), buf.address + ALIGN, ALIGN, ALIGN, lambda n, e: ran.append(n), size=f.size,
                    after=ok.set)
        assert ok.wait(30)
        assert bytes(buf.view[:2 * ALIGN]) == data[:2 * ALIGN]
    assert ran == [ALIGN, ALIGN] and any(isinstance(e, ValueError) for e in reader.callback_errors)
