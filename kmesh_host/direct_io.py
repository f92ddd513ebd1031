"""O_DIRECT reads into aligned (optionally pinned) host buffers, on a thread pool.

O_DIRECT needs the buffer address, the file offset and the length to be multiples of the device's
logical block size; 4096 covers every device we meet. Buffers come from anonymous ``mmap`` (page
aligned) and are page-locked with ``cudaHostRegister`` when CUDA is available, so async H2D copies
can read them. Reads are split into chunks and go through io_uring where the kernel offers it
(:mod:`kmesh_host.uring`: all chunks handed to the kernel in one call, one completion thread),
else through a thread pool of ``os.preadv`` calls (the GIL is released during each call); the
engine says which (``ReadEngine.engine``) and reports carry it.

Where a filesystem refuses O_DIRECT (EINVAL at open or at the first read) the file is read through
the page cache instead and the reader says so (``o_direct=False`` with the reason); callers that
need cold reads then drop the file's cached pages with ``posix_fadvise(DONTNEED)``.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from kmesh_gpu.errors import IntegrityError, StorageError

ALIGN = 4096
_FENCES_PRUNED_AT = 8  # a buffer's recorded copy fences are pruned (completed ones dropped) at this many


def round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def round_down(n: int, a: int = ALIGN) -> int:
    return n - n % a


class HostBuffer:
    """``nbytes`` of page-aligned host memory, page-locked (pinned) when ``pin`` is true.

    Owns the mapping; :meth:`close` unregisters and unmaps it after waiting for the copy fence
    (the CUDA event of the last async copy that reads it). ``tensor`` is a uint8 view of all of it.
    """

    def __init__(self, nbytes: int, *, pin: bool = False):
        if nbytes <= 0:
            raise ValueError(f"nbytes: expected a positive size, got {nbytes}")
        self.nbytes = round_up(nbytes)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(anchor)
        del anchor
        self.pinned = False
        self._fences: list = []
        self._fence_lock = threading.Lock()
        if pin:
            rc = torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, 0)
            code = int(rc)
            if code != 0:
                self._map.close()
                raise StorageError(f"cudaHostRegister of {self.nbytes} bytes failed (cudaError {code})")
            self.pinned = True
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def set_fence(self, event) -> None:
        """Record that an async copy reading this buffer completes when ``event`` does.

        Several children may copy from one retained buffer on different streams, so every fence
        is kept (those already complete are dropped) and :meth:`wait` waits for all of them.
        """
        if event is None:
            return
        with self._fence_lock:
            if len(self._fences) >= _FENCES_PRUNED_AT:  # a query costs a driver call: prune now and then
                self._fences = [e for e in self._fences if not e.query()]
            self._fences.append(event)

    def wait(self) -> None:
        """Block until no recorded async copy still reads this buffer."""
        with self._fence_lock:
            fences, self._fences = self._fences, []
        for event in fences:
            event.synchronize()

    def close(self) -> None:
        if self._map is None:
            return
        self.wait()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
        self.tensor = None
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            # A caller still holds a view; the mapping goes when that view does.
            pass
        self._map = None

    @property
    def closed(self) -> bool:
        return self._map is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DirectFile:
    """A file opened for reading with O_DIRECT where the filesystem allows it.

    Attributes:
        o_direct: whether reads bypass the page cache.
        fallback_reason: why not (``None`` when they do).
    """

    def __init__(self, path: str, *, direct: bool = True):
        self.path = path
        self.o_direct = False
        self.fallback_reason = None if direct else "O_DIRECT not requested"
        flags = os.O_RDONLY | os.O_CLOEXEC
        self._fd = -1
        self._retired: list[int] = []  # descriptors replaced by a fallback: reads may still name them
        self._lock = threading.Lock()
        if direct:
            try:
                self._fd = os.open(path, flags | os.O_DIRECT)
                self.o_direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.fallback_reason = f"filesystem refused O_DIRECT at open ({exc.strerror})"
        if self._fd < 0:
            self._fd = os.open(path, flags)
        self.size = os.fstat(self._fd).st_size

    def fileno(self) -> int:
        return self._fd

    def _fall_back(self, exc: OSError) -> None:
        with self._lock:
            if not self.o_direct:
                return
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            # Not closed here: reads queued on io_uring carry the old descriptor NUMBER; closing it
            # now lets any open() reuse the number and those reads read another file.
            self._retired.append(self._fd)
            self._fd = fd
            self.o_direct = False
            self.fallback_reason = f"filesystem refused an O_DIRECT read ({exc.strerror})"

    def pread_into(self, view: memoryview, offset: int) -> int:
        """Read ``len(view)`` bytes at ``offset`` (short only at end of file); returns bytes read.

        With O_DIRECT, ``view``'s address, ``offset`` and ``len(view)`` must be 4096-aligned.
        """
        done, want = 0, len(view)
        while done < want:
            try:
                n = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.o_direct and done == 0:
                    self._fall_back(exc)
                    continue
                raise StorageError(f"read of {self.path} at {offset + done} failed: {exc}") from exc
            done += n
            # A short read means end of file (O_DIRECT reads past EOF stop there).
            if n == 0 or offset + done >= self.size:
                break
        return done

    def drop_cache(self) -> None:
        """Drop this file's clean pages from the page cache (needs no privileges)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        while self._retired:
            os.close(self._retired.pop())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


ENGINES = ("auto", "io_uring", "threads")


def _address(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    anchor = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


class ReadEngine:
    """Reads file ranges in chunks into aligned buffers: through io_uring where the kernel offers
    it, else on a thread pool of ``os.preadv`` calls (the engine is owned here).

    ``engine``: ``"auto"`` (io_uring when :func:`kmesh_host.uring.available`, else threads),
    ``"io_uring"`` (required: :class:`StorageError` if it is not available) or ``"threads"``.
    ``threads`` is the queue depth either way: reads in flight at once (io_uring) or reading
    threads (pool). :attr:`engine` says which one runs, :attr:`engine_note` why when it is not
    io_uring.

    :meth:`submit` starts the chunk reads of one range and returns a :class:`RangeRead`; its
    :meth:`RangeRead.chunks` yields each chunk in file order as soon as it is in memory, so the
    caller can start copying it to the GPU while later chunks are still being read.
    :meth:`start` is its callback form: each chunk reports itself as it lands (from the io_uring
    completion thread or the reading thread), in any order, so one caller can keep the chunks of
    many ranges in flight without a thread per range. Chunks are served first in, first out:
    ranges started in order are read in order, ``threads`` chunks at a time.
    """

    def __init__(self, threads: int = 4, chunk_bytes: int = 1 << 20, *, engine: str = "auto"):
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes: expected a positive multiple of {ALIGN}, got {chunk_bytes}")
        if engine not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
        self.threads = max(1, int(threads))
        self.chunk_bytes = chunk_bytes
        self._uring = self._pool = None
        self._description = None
        self.engine, self.engine_note = "threads", "threads requested"
        if engine != "threads":
            from . import uring

            ok, why = uring.available()
            if ok:
                self._uring = uring.UringReader(self.threads)
                self.engine, self.engine_note = "io_uring", ""
            elif engine == "io_uring":
                raise StorageError(f"io_uring requested but not usable here: {why}")
            else:
                self.engine_note = why
        if self._uring is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kmesh-read")

    @property
    def description(self) -> str:
        if self._description is None:
            self._description = f"io_uring (queue depth {self.threads})" if self.engine == "io_uring" else \
                f"os.preadv on {self.threads} threads ({self.engine_note})"
        return self._description

    def _chunks(self, file: DirectFile, offset: int, length: int, buffer: memoryview):
        lead = offset % ALIGN
        start = offset - lead
        total = round_up(lead + length)
        if len(buffer) < total:
            raise ValueError(f"buffer: {len(buffer)} bytes cannot hold the aligned range of {total}")
        return lead, start, [(a, min(total, a + self.chunk_bytes)) for a in range(0, total, self.chunk_bytes)]

    def _read(self, file: DirectFile, buffer: memoryview, base: int, a: int, b: int, file_offset: int,
              done: Callable[[int, BaseException | None], None], after: Callable[[], None] | None = None) -> None:
        """Read ``buffer[a:b]`` from ``file_offset``; ``done(nbytes, error)`` once it is whole or failed,
        then ``after()`` (see :meth:`start`)."""
        if self._uring is not None:
            view = buffer[a:b]
            # a failed read is redone synchronously: it raises the StorageError, or (EINVAL on the
            # first O_DIRECT read) the file falls back to the page cache as on the thread pool
            self._uring.read(file.fileno(), base + a, b - a, file_offset, done, size=file.size,
                             retry=lambda: file.pread_into(view, file_offset), after=after)
            return

        def run():
            try:
                n = file.pread_into(buffer[a:b], file_offset)
            except BaseException as exc:
                done(0, exc)
            else:
                done(n, None)
            if after is not None:
                after()

        self._pool.submit(run)

    def submit(self, file: DirectFile, offset: int, length: int, buffer: memoryview, *,
               name: str = "") -> "RangeRead":
        """Read ``file[offset : offset + length]`` into ``buffer``.

        ``buffer`` must start page aligned and hold ``round_up(offset % 4096 + length)`` bytes;
        the data lands at ``buffer[offset % 4096:]`` (the aligned superset of the range is read).
        """
        lead, start, chunks = self._chunks(file, offset, length, buffer)
        base = _address(buffer) if self._uring is not None else 0
        pieces = []
        for a, b in chunks:
            fut: Future = Future()
            pieces.append((a, b, fut))
            try:
                self._read(file, buffer, base, a, b, start + a, functools.partial(_settle, fut))
            except Exception as exc:  # not queued: this chunk fails (the others are still waited for)
                fut.set_exception(exc if isinstance(exc, StorageError) else
                                  StorageError(f"segment {name or file.path}: read at {start + a} could not be "
                                               f"queued: {exc}"))
        return RangeRead(file, name or file.path, lead, length, pieces)

    def start(self, file: DirectFile, offset: int, length: int, buffer: memoryview,
              on_chunk: Callable[[int, int, BaseException | None], None], *, name: str = "",
              after: Callable[[], None] | None = None) -> int:
        """Start reading ``file[offset : offset + length]`` into ``buffer`` (placed as in :meth:`submit`).

        ``on_chunk(lo, hi, error)`` runs once per chunk, as it completes (any order), on the
        engine's completion thread: ``buffer[lo:hi]`` (clipped to the requested bytes) is in memory
        when ``error`` is ``None``; otherwise ``error`` is the read's StorageError, or an
        IntegrityError when the file ends inside the range. Returns the number of chunks, i.e. of
        ``on_chunk`` calls to expect.

        ``after()`` (optional) runs on the same thread after a group of ``on_chunk`` calls that
        completed together: with io_uring once per wake-up of the completion thread that reaped
        any of this range's reads (after every callback of that wake-up), on the thread pool after
        each chunk's ``on_chunk``. A hint for batching follow-up work; it is not called for chunks
        that fail before they are queued.
        """
        lead, start, chunks = self._chunks(file, offset, length, buffer)
        end = lead + length
        label = name or file.path
        base = _address(buffer) if self._uring is not None else 0
        for a, b in chunks:
            done = functools.partial(_chunk_done, a, b, lead, end, label, on_chunk)
            try:
                self._read(file, buffer, base, a, b, start + a, done, after)
            except Exception as exc:  # not queued (engine closed, io_uring_enter failed): this chunk fails
                done(0, exc if isinstance(exc, StorageError) else
                     StorageError(f"segment {label}: read at {start + a} could not be queued: {exc}"))
        return len(chunks)

    def read(self, file: DirectFile, offset: int, length: int, buffer: memoryview, *, name: str = "") -> memoryview:
        """Blocking :meth:`submit`; returns the view of exactly the requested bytes."""
        rr = self.submit(file, offset, length, buffer, name=name)
        for _ in rr.chunks():
            pass
        return buffer[rr.lead:rr.lead + length]

    def close(self) -> None:
        if self._uring is not None:
            self._uring.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _settle(fut: Future, n: int, error: BaseException | None) -> None:
    if error is None:
        fut.set_result(n)
    else:
        fut.set_exception(error)


def _chunk_done(a: int, b: int, lead: int, end: int, name: str, on_chunk, n: int, error: BaseException | None) -> None:
    """One chunk of :meth:`ReadEngine.start` finished: report it, a short file as IntegrityError."""
    if error is None and a + n < min(b, end):
        error = IntegrityError(f"segment {name}: file ends at {a + n} bytes into the read range, "
                               f"expected {end} (truncated)")
    on_chunk(max(a, lead), min(b, end), error)


class RangeRead:
    """The chunk reads of one range in flight (see :meth:`ReadEngine.submit`)."""

    def __init__(self, file: DirectFile, name: str, lead: int, length: int, pieces: list[tuple[int, int, Future]]):
        self.file, self.name, self.lead, self.length = file, name, lead, length
        self._pieces = pieces

    def chunks(self, on_chunk: Callable[[int, int], None] | None = None):
        """Yield ``(start, stop)`` buffer ranges in order as each is read; raise on a short file.

        On failure the remaining reads are waited for (never left writing a buffer the caller
        is about to free) and the first error is raised.
        """
        end = self.lead + self.length
        try:
            for a, b, fut in self._pieces:
                n = fut.result()
                if a + n < min(b, end):
                    raise IntegrityError(f"segment {self.name}: file ends at {a + n} bytes into the read "
                                         f"range, expected {end} (truncated)")
                lo, hi = max(a, self.lead), min(b, end)
                if lo < hi:
                    if on_chunk is not None:
                        on_chunk(lo, hi)
                    yield lo, hi
        finally:
            self.wait()

    def wait(self) -> None:
        for _, _, fut in self._pieces:
            try:
                fut.result()
            except BaseException:  # already reported by chunks(); here we only wait for the writer to stop
                pass


def file_o_direct_support(path: str) -> tuple[bool, str | None]:
    """Whether ``path`` can be read with O_DIRECT, and why not."""
    with DirectFile(path) as f:
        if not f.o_direct:
            return False, f.fallback_reason
        with HostBuffer(ALIGN) as buf:
            f.pread_into(buf.view[:ALIGN], 0)
        return f.o_direct, f.fallback_reason


__all__ = ["ALIGN", "ENGINES", "HostBuffer", "DirectFile", "ReadEngine", "RangeRead",
           "round_up", "round_down", "file_o_direct_support"]
