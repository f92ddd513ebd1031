"""Unix-socket set-up of the cache service: a private directory, a 0600 socket, peer credentials."""

from __future__ import annotations

import os
import socket
import stat
import struct

from kmesh_gpu.errors import OwnershipError, ServiceError

from .registry import PeerIdentity


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
