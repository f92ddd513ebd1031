"""A connection's shared-memory channel: restore requests and their replies without the socket.

A restore through the socket pays for two socket hops and the wake-ups of the threads that read
them, tens of microseconds against a placement of under a hundred. A client may therefore ask
for a channel (``open_channel``, a JSON request on its authenticated connection); the service
creates one shared page and two event file descriptors (one to wake each side) and hands the three
descriptors over the same socket (``SCM_RIGHTS``). The channel belongs to that connection alone:
only that peer received it, it closes when the connection closes, and the service serves what
arrives on it exactly as a frame read from that connection (the same decoding, the same
authorisation by registration secret and peer, the same checks, holds and drains). It carries
binary restore frames and their reply frames, byte for byte the frames of :mod:`.protocol`, one
request at a time; every other request, and a frame larger than the channel, takes the socket.

The page (int64 words; each side's words on a cache line of their own)::

    word 0  MAGIC          word 1  request capacity (bytes)   word 2  reply capacity   word 3  closed
    word 8  request seq    word 9  request length             word 10 service asleep
    word 16 reply seq      word 17 reply length               word 18 client asleep
    byte 4096: the request area, then the reply area

A side writes its frame, then its length and sequence number (release), then reads the other
side's asleep word after a full fence; the waiting side polls the sequence word (acquire) for a
while without sleeping (:mod:`._channel_jit`, without the GIL), then sets its asleep word, fences,
looks once more and sleeps on its event descriptor. The fences make the handshake safe: either
the writer sees the sleeper's word and writes its event, or the sleeper sees the new number.

Nothing on the page is trusted by the service: the length is bounded by the capacity, the frame is
copied out of the page before it is parsed (the client could change the page meanwhile), and a
frame that does not parse is answered with an error reply; the channel stays usable.
"""

from __future__ import annotations

import functools
import mmap
import os
import select
import socket
import threading
import time

import numpy as np

from kmesh_gpu.errors import ProtocolError, ServiceError

from . import protocol

MAGIC = 0x314E4843_48534D4B  # the bytes b"KMSHCHN1" read as a little-endian int64 (checked by the client)
W_MAGIC, W_CAPACITY, W_REPLY_CAPACITY, W_CLOSED = 0, 1, 2, 3
W_REQ_SEQ, W_REQ_LEN, W_SERVICE_ASLEEP = 8, 9, 10
W_REP_SEQ, W_REP_LEN, W_CLIENT_ASLEEP = 16, 17, 18
DATA_OFFSET = 4096
#: default request capacity: a restore of a few thousand tokens per item list (the seed child's
#: frame is about 7 KiB); larger frames take the socket
DEFAULT_CAPACITY = 1 << 20
REPLY_CAPACITY = 64 << 10
#: the file descriptors an ``open_channel`` reply is followed by: page, service's event, client's event
FD_COUNT = 3


@functools.lru_cache(maxsize=1)
def compiled():
    """:mod:`._channel_jit`, or ``None`` where Numba cannot compile here (no channels then)."""
    try:
        from . import _channel_jit
        return _channel_jit
    except Exception:
        return None


class Page:
    """The shared page mapped in this process: control words and the two areas."""

    def __init__(self, fd: int, capacity: int, reply_capacity: int):
        self.capacity, self.reply_capacity = capacity, reply_capacity
        self.size = DATA_OFFSET + capacity + reply_capacity
        self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.words = np.frombuffer(self.map, dtype=np.int64, count=DATA_OFFSET // 8)
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        self.base = self.words.ctypes.data
        self.request = self.bytes[DATA_OFFSET:DATA_OFFSET + capacity]
        self.reply = self.bytes[DATA_OFFSET + capacity:self.size]
        self.ts = np.zeros(2, dtype=np.int64)  # clock scratch of the compiled poll

    def at(self, word: int) -> int:
        return self.base + 8 * word

    def close(self) -> None:
        self.words = self.bytes = self.request = self.reply = None
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


def check_prefix(prefix, length: int, max_body_bytes: int) -> tuple[int, int, int]:
    """``(flags, header_len, body_len)`` of a frame of ``length`` bytes on the channel, whose first
    16 bytes are ``prefix``; raises :class:`ProtocolError` when anything disagrees."""
    magic, version, flags, header_len, body_len = protocol.PREFIX.unpack_from(prefix)
    if magic != protocol.MAGIC or version != protocol.VERSION or flags & ~protocol.FLAG_BINARY:
        raise ProtocolError(f"channel frame: bad prefix (magic {bytes(magic)!r}, version {version}, flags {flags:#x})")
    if not 0 < header_len <= protocol.MAX_HEADER_BYTES or body_len > max_body_bytes \
            or protocol.PREFIX.size + header_len + body_len != length:
        raise ProtocolError(f"channel frame: header {header_len} and body {body_len} bytes do not make the "
                            f"{length} bytes written")
    return flags, header_len, body_len


def _drain_event(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except (BlockingIOError, OSError):
        pass


# ---------------------------------------------------------------------------------- service side
class ServiceChannel:
    """The service's end of one connection's channel: a thread that serves what the client posts.

    ``serve(header_raw, body, received_ns) -> reply frame bytes`` is the service's handler of a
    binary frame from this connection; ``busy`` an int64 array whose first word is non-zero while
    the service handles requests (polling then stops early and leaves the CPU to them)."""

    def __init__(self, serve, *, name: str, capacity: int = DEFAULT_CAPACITY, spin_s: float = 0.0,
                 busy: np.ndarray | None = None, max_body_bytes: int = protocol.DEFAULT_MAX_BODY_BYTES,
                 idle_check_s: float = 0.2, on_request=None):
        jit = compiled()
        if jit is None:
            raise ServiceError("channel: the compiled handshake is not available here (Numba)")
        self._jit, self._serve, self._on_request = jit, serve, on_request
        self._spin_ns = int(spin_s * 1e9)
        self._busy = busy
        self._max_body = max_body_bytes
        self._idle_ms = max(1, int(idle_check_s * 1000))
        self._clock = jit.clock_address()
        self._closing = False
        fd = os.memfd_create("kmesh-channel", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, DATA_OFFSET + capacity + REPLY_CAPACITY)
            self.page = Page(fd, capacity, REPLY_CAPACITY)
        except BaseException:
            os.close(fd)
            raise
        self.fds = [fd, os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK), os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)]
        w = self.page.words
        w[W_CAPACITY], w[W_REPLY_CAPACITY], w[W_MAGIC] = capacity, REPLY_CAPACITY, MAGIC
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._started = True
        self.thread.start()

    def close(self) -> None:
        """Stop serving: the thread finishes the request it has (if any), then unmaps and closes."""
        with self._lock:
            self._closing = True
            started = self._started
        if not started:  # never served: nothing else uses the page or the descriptors
            self._release()
            return
        words = self.page.words
        if words is not None:
            words[W_CLOSED] = 1
        try:
            os.eventfd_write(self.fds[1], 1)
        except OSError:
            pass

    def _release(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.page.close()

    def _run(self) -> None:
        jit, page = self._jit, self.page
        seq_at, closed_at = page.at(W_REQ_SEQ), page.at(W_CLOSED)
        asleep_at = page.at(W_SERVICE_ASLEEP)
        busy_at = 0 if self._busy is None else self._busy.ctypes.data
        wake = select.poll()
        wake.register(self.fds[1], select.POLLIN)
        last = 0
        try:
            while not self._closing:
                seq = jit.poll(seq_at, last, closed_at, busy_at, self._spin_ns, self._clock, page.ts)
                if seq == last:
                    seq = jit.arm(asleep_at, seq_at, last)
                    if seq == last:
                        wake.poll(self._idle_ms)
                        _drain_event(self.fds[1])
                        jit.disarm(asleep_at)
                        continue
                last = seq
                self._answer(seq)
        finally:
            self._release()

    def _answer(self, seq: int) -> None:
        received = time.monotonic_ns()
        page = self.page
        length = int(page.words[W_REQ_LEN])
        rid = None
        try:
            if not protocol.PREFIX.size <= length <= page.capacity:
                raise ProtocolError(f"channel frame: length {length} outside {protocol.PREFIX.size}..{page.capacity}")
            # copied out first: the client could rewrite the page while the request is checked
            frame = bytearray(page.request[:length])
            flags, header_len, _ = check_prefix(frame, length, self._max_body)
            view = memoryview(frame)[protocol.PREFIX.size:]
            if not flags & protocol.FLAG_BINARY:
                raise ProtocolError("channel: carries binary restore frames only; send other requests on the socket")
            rid = protocol.binary_request_id(view[:header_len])
            if self._on_request is not None:
                self._on_request()
            reply = self._serve(view[:header_len], view[header_len:], received)
        except ProtocolError as exc:
            reply = protocol.encode(protocol.error_reply(rid, exc))
        if len(reply) > page.reply_capacity:  # an error reply with a very long message: say so, shorter
            reply = protocol.encode(protocol.error_reply(rid, ServiceError(
                f"reply of {len(reply)} bytes does not fit the channel's {page.reply_capacity}")))
        n = len(reply)
        page.reply[:n] = np.frombuffer(reply, dtype=np.uint8)
        if self._jit.post(page.at(W_REP_SEQ), page.at(W_REP_LEN), page.at(W_CLIENT_ASLEEP), seq, n):
            try:
                os.eventfd_write(self.fds[2], 1)
            except OSError:
                pass


# ---------------------------------------------------------------------------------- client side
class ChannelBroken(ServiceError):
    """The channel can no longer be used (service gone, or a reply that never came)."""


class ClientChannel:
    """The client's end: posts a frame and waits for the reply (polling, then asleep on its event
    descriptor while also watching the connection, whose end means the service is gone)."""

    def __init__(self, fds: list[int], sock: socket.socket):
        jit = compiled()
        if jit is None:
            raise ServiceError("channel: the compiled handshake is not available here (Numba)")
        page_fd, self._service_fd, self._client_fd = fds
        try:
            size = os.fstat(page_fd).st_size
            header = mmap.mmap(page_fd, DATA_OFFSET, mmap.MAP_SHARED, mmap.PROT_READ)
            try:
                magic, capacity, reply_capacity = np.frombuffer(header, dtype=np.int64, count=3).tolist()
            finally:
                header.close()
            if magic != MAGIC or capacity <= 0 or reply_capacity <= 0 or DATA_OFFSET + capacity + reply_capacity != size:
                raise ProtocolError("channel: the page handed over is not a KMesh channel")
            self.page = Page(page_fd, capacity, reply_capacity)
        finally:
            os.close(page_fd)
        self._jit = jit
        self._clock = jit.clock_address()
        self._seq = 0
        self._wait = select.poll()
        self._wait.register(self._client_fd, select.POLLIN)
        self._wait.register(sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        self.capacity = capacity

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def exchange(self, parts: list, nbytes: int, *, spin_s: float, timeout: float | None,
                 max_body_bytes: int) -> tuple[int, bytearray, memoryview]:
        """Post the frame ``parts`` (``nbytes`` in all; as :func:`.protocol.restore_frame` returns
        it: the prefix and header as bytes, whose length is a multiple of 8, then int64 arrays) and
        return its reply as :func:`.protocol.read_frame` would: ``(flags, buffer, body)``."""
        page, jit = self.page, self._jit
        if page.words is None or page.words[W_CLOSED]:
            raise ChannelBroken("channel: closed by the service")
        request = page.request
        head = len(parts[0])
        request[:head] = np.frombuffer(parts[0], dtype=np.uint8)
        if len(parts) > 1:  # the index arrays, end to end, in one call
            np.concatenate(parts[1:], out=request[head:nbytes].view(np.int64))
        self._seq += 1
        seq = self._seq
        if jit.post(page.at(W_REQ_SEQ), page.at(W_REQ_LEN), page.at(W_SERVICE_ASLEEP), seq, nbytes):
            os.eventfd_write(self._service_fd, 1)
        rep_at, closed_at = page.at(W_REP_SEQ), page.at(W_CLOSED)
        got = jit.poll(rep_at, seq - 1, closed_at, 0, int(spin_s * 1e9), self._clock, page.ts)
        if got != seq:
            got = self._sleep_for(seq, timeout)
        length = int(page.words[W_REP_LEN])
        if not protocol.PREFIX.size <= length <= page.reply_capacity:
            raise ChannelBroken(f"channel: reply length {length} out of range")
        reply = page.reply
        flags, header_len, _ = check_prefix(reply, length, max_body_bytes)
        buf = bytearray(reply[protocol.PREFIX.size:length])
        return flags, buf, memoryview(buf)[header_len:]

    def _sleep_for(self, seq: int, timeout: float | None) -> int:
        page, jit = self.page, self._jit
        asleep_at, rep_at = page.at(W_CLIENT_ASLEEP), page.at(W_REP_SEQ)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = jit.arm(asleep_at, rep_at, seq - 1)
            if got == seq:
                return got
            if page.words[W_CLOSED]:
                raise ChannelBroken("channel: closed by the service before the reply")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ChannelBroken(f"channel: no reply within {timeout} s")
            events = self._wait.poll(None if left is None else max(1, int(left * 1000)))
            jit.disarm(asleep_at)
            for fd, ev in events:
                if fd == self._client_fd:
                    _drain_event(fd)
                elif ev & (select.POLLHUP | select.POLLERR | select.POLLIN):
                    # the service never writes the socket while a channel request is out: its end
                    if jit.load(rep_at) == seq:
                        return seq
                    raise ChannelBroken("channel: the service's connection ended before the reply")
            if jit.load(rep_at) == seq:
                return seq

    def close(self) -> None:
        for fd in (self._service_fd, self._client_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.page.close()
