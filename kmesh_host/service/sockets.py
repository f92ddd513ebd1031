"""Unix-socket set-up of the cache service: a private directory, a 0600 socket, peer credentials,
and the file descriptors that follow a request's frame (``SCM_RIGHTS``: a virtual-memory cache's
chunks, a channel's page and eventfds)."""

from __future__ import annotations

import os
import socket
import stat
import struct

from kmesh_gpu.errors import KmeshError, OwnershipError, ProtocolError, ServiceError

from .registry import PeerIdentity

#: SCM_RIGHTS carries at most 253 descriptors per message on Linux (SCM_MAX_FD)
FDS_PER_MESSAGE = 253
#: the byte that carries each batch of descriptors
FD_MARK = b"\x00"


def prepare_socket_dir(socket_path: str) -> None:
    """Create the socket's directory private (0700), or check that an existing one is ours and private."""
    d = os.path.dirname(os.path.abspath(socket_path))
    if not os.path.isdir(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)
    st = os.stat(d)
    if st.st_uid != os.getuid():
        raise ServiceError(f"socket directory {d}: owned by uid {st.st_uid}, not this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ServiceError(f"socket directory {d}: mode {stat.S_IMODE(st.st_mode):o} lets others in; "
                           "use a directory with mode 0700 (or a path whose directory does not exist yet)")


def peer_identity(conn: socket.socket) -> PeerIdentity:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerIdentity(pid, uid, gid)


def check_peer(peer: PeerIdentity, service_uid: int) -> None:
    """Only the service's own user may connect (root is not special: it can read the secrets anyway)."""
    if peer.uid != service_uid:
        raise OwnershipError(f"peer uid {peer.uid} is not the service's uid {service_uid}")


def bind_socket(socket_path: str) -> socket.socket:
    prepare_socket_dir(socket_path)
    try:
        mode = os.lstat(socket_path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISSOCK(mode):
        raise ServiceError(f"socket {socket_path}: exists and is not a socket (left as it is)")
    if mode is not None:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(socket_path)
        except OSError:
            os.unlink(socket_path)  # stale socket of a service that is gone
        else:
            raise ServiceError(f"socket {socket_path}: another service is already listening")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is created 0600, never briefly wider
    try:
        sock.bind(socket_path)
    finally:
        os.umask(old)
    os.chmod(socket_path, 0o600)
    sock.listen(64)
    return sock


_PR_SET_NAME = 15


def name_native_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 bytes) in the kernel too, where ``top -H``,
    ``ps -L`` and /proc show it (Python's thread names stay inside the interpreter). Best effort:
    nothing happens where libc or ``prctl`` is not there."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class FdStream:
    """The descriptors a client sends after a request's frame (a register's virtual-memory chunks, a
    channel's page and eventfds): ``count`` of them (service side; one per request that announces
    ``fds``), in messages of at most :data:`FDS_PER_MESSAGE`, each message carrying descriptors of
    one memory only (a per-layer registration sends each layer's in its own messages).

    :meth:`read` takes the next ``n`` and hands each to ``on_fd(fd)``, which must not keep it (each
    is closed right after). All ``n`` are read even when ``on_fd`` raises (the first such error is
    raised at the end), so the connection stays in step; :meth:`drain` reads and closes whatever was
    not read (a request refused before its memory was mapped). A message that is missing, late or
    malformed raises :class:`ProtocolError`; the stream is then out of step, and the connection's
    next read closes it.
    """

    def __init__(self, sock: socket.socket | None, count: int, timeout: float | None):
        if sock is None and count:
            raise ProtocolError("memory: file descriptors announced on a connection that cannot carry them")
        self.sock, self.count, self.timeout = sock, int(count), timeout
        self.left = self.count

    @property
    def done(self) -> bool:
        return self.left == 0

    def read(self, on_fd, n: int | None = None) -> None:
        n = self.left if n is None else n
        if not 0 < n <= self.left:
            raise ProtocolError(f"memory: {n} file descriptors wanted, {self.left} of {self.count} announced are left")
        first_error = None
        sock = self.sock
        previous = sock.gettimeout()
        sock.settimeout(self.timeout)
        try:
            got = 0
            while got < n:
                try:
                    msg, fds, flags, _ = socket.recv_fds(sock, 1, FDS_PER_MESSAGE)
                except OSError as exc:  # socket.timeout included
                    self.left = -1  # out of step: nothing more is read from this stream
                    raise ProtocolError(f"memory: {n - got} of {n} file descriptors did not arrive ({exc})") from exc
                try:
                    if msg != FD_MARK or not 0 < len(fds) <= n - got or flags & getattr(socket, "MSG_CTRUNC", 0):
                        self.left = -1
                        raise ProtocolError(f"memory: expected a message of 1..{n - got} file descriptors, got "
                                            f"{len(fds)} with {msg!r}")
                    for fd in fds:
                        if first_error is None:
                            try:
                                on_fd(fd)
                            except BaseException as exc:  # read on: the stream stays in step
                                first_error = exc
                finally:
                    for fd in fds:
                        os.close(fd)
                got += len(fds)
                self.left -= len(fds)
        finally:
            sock.settimeout(previous)
        if first_error is not None:
            raise first_error

    def drain(self) -> None:
        """Read and close the descriptors not read yet (errors ignored: the connection then closes)."""
        if self.left > 0:
            try:
                self.read(lambda fd: None)
            except KmeshError:
                pass
