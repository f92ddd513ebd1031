"""``SegmentStore``: segment files (Arrow IPC, see :mod:`kmesh_host.segment`) under one root.

Layout: ``<root>/segments/<key[:2]>/<key>.arrow``. The key is derived from the content, so putting
the same segment twice writes the same file, and the directory is the whole index: a new instance
on the same root finds every segment (nothing is kept only in memory).

Writes go to a unique temporary name in the same directory, are fsynced, renamed over the final
name (atomic on POSIX; concurrent writers of one key each rename a complete file with the same
content) and the directory is fsynced. A failed write removes its temporary file. Readers never
see a partial file under a final name.

``root`` is a local path, a ``file://`` URI or any ``pyarrow.fs`` URI (``s3://...``); local
filesystems get fsync and O_DIRECT reads, other filesystems go through ``pyarrow.fs`` (on object
stores a single PUT is already atomic, so the temporary name is skipped there). On a ``pyarrow.fs``
filesystem whose ``move`` is not atomic (a copy, as some filesystem bindings do it), a reader during
a write can find a partial file under the final name: the digests refuse it (``IntegrityError``
naming the key), never wrong data, and a failed move removes what it left there.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import uuid
from collections import OrderedDict

import pyarrow as pa
import pyarrow.fs as pafs
import torch

from kmesh_gpu.errors import IntegrityError, SegmentNotFound, StorageError

from .segment import (
    ARROW_MAGIC,
    DEFAULT_CHUNK_SIZE,
    FORMAT_NAME,
    MIN_FILE_SIZE,
    ModelFingerprint,
    Segment,
    SegmentHeader,
    check_fingerprint,
    check_payload,
    decode_header,
    encode_segment,
    is_key,
    read_schema_head,
    segment_from_payload,
)

SUFFIX = ".arrow"
_HEAD_PROBE = 4096
_HEAD_PROBE_MAX = 1 << 20
# After the payload comes only the Arrow footer (the schema again and one block): a few KiB.
_TAIL_MAX = 1 << 20
_ATOMIC_PUT_FILESYSTEMS = ("s3", "gcs", "abfs")
_FORMAT_NAME_BYTES = FORMAT_NAME.encode()
_HEADER_CACHE_ENTRIES = 4096


class SegmentStore:
    """Segment files under ``root`` (a path or a ``pyarrow.fs`` URI).

    Methods: :meth:`put`, :meth:`get`, :meth:`verify`, :meth:`delete`, :meth:`keys` (the public
    contract), plus :meth:`read_header` and :meth:`local_path` used by the host tier and the routes.
    Safe to use from several threads and processes at once.
    """

    def __init__(self, root, *, filesystem: pafs.FileSystem | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 header_cache: bool = True):
        if filesystem is None:
            root = os.fspath(root)
            if "://" in root:
                filesystem, root = pafs.FileSystem.from_uri(root)
            else:
                filesystem, root = pafs.LocalFileSystem(), os.path.abspath(root)
        self.filesystem = filesystem
        self.local = isinstance(filesystem, pafs.LocalFileSystem)
        self.root = str(root).rstrip("/") or "/"
        self.chunk_size = chunk_size
        self._dir = f"{self.root.rstrip('/')}/segments"  # root "/" (or ""): "/segments", never "//segments"
        try:
            if self.local:
                os.makedirs(self._dir, exist_ok=True)
            else:
                filesystem.create_dir(self._dir, recursive=True)
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"segment store {self.root!r}: cannot create {self._dir}: {exc}") from exc
        self._lock = threading.Lock()
        # Parsed headers of local files, keyed by key and checked against the file's identity
        # (device, inode, size, mtime) on every use: parsing costs ~0.5 ms, an fstat microseconds.
        self._header_cache: OrderedDict[str, tuple[tuple, SegmentHeader]] | None = \
            OrderedDict() if header_cache and self.local else None
        self.stats = {"puts": 0, "writes": 0, "file_reads": 0, "header_reads": 0, "header_cache_hits": 0}

    def __repr__(self) -> str:
        kind = "local" if self.local else self.filesystem.type_name
        return f"SegmentStore({self.root!r}, {kind})"

    # ------------------------------------------------------------------ paths
    def path(self, key: str) -> str:
        """Where the segment ``key`` lives (on this store's filesystem)."""
        if not is_key(key):
            raise SegmentNotFound(f"segment {key!r}: not a segment key (64 lowercase hex digits)")
        return f"{self._dir}/{key[:2]}/{key}{SUFFIX}"

    def local_path(self, key: str) -> str:
        """The OS path of ``key``'s file; the routes need a local filesystem."""
        if not self.local:
            raise StorageError(f"{self!r}: not a local filesystem; direct storage routes need local files")
        return self.path(key)

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

    # ------------------------------------------------------------------ put
    def put(self, kv: torch.Tensor, token_ids, positions, *, model_fingerprint: ModelFingerprint) -> str:
        """Store one segment; returns its content-derived key (idempotent for identical input).

        Args:
            kv: ``(2, L, T, H, D)`` tensor (any device) in the fingerprint's dtype (fp8 as uint8 or
                float8_e4m3fn).
            token_ids, positions: ``int64[T]``; positions are the original (pre-shift) positions.
            model_fingerprint: the model that computed ``kv``.
        """
        key, data = encode_segment(kv, token_ids, positions, model_fingerprint=model_fingerprint,
                                   chunk_size=self.chunk_size)
        self._count("puts")
        path = self.path(key)
        try:
            self._read_verified(key, sha=True)
            return key
        except SegmentNotFound:
            pass
        except IntegrityError:
            pass  # a damaged copy is replaced below
        self._write(path, data)
        self._count("writes")
        return key

    def _write(self, path: str, data: pa.Buffer) -> None:
        directory = path.rsplit("/", 1)[0]
        tmp = f"{directory}/.{path.rsplit('/', 1)[1]}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        if self.local:
            self._write_local(directory, tmp, path, data)
            return
        fs = self.filesystem
        atomic_put = fs.type_name in _ATOMIC_PUT_FILESYSTEMS
        target = path if atomic_put else tmp
        moving = False
        try:
            fs.create_dir(directory, recursive=True)
            with fs.open_output_stream(target) as out:
                out.write(data)
            if not atomic_put:
                moving = True
                fs.move(tmp, path)
        except BaseException as exc:
            if not atomic_put:
                self._remove_quietly(tmp)
            if atomic_put or moving:
                # The final name may hold a complete copy by a concurrent writer of this key (keep
                # it), or what this failed PUT / non-atomic move left there (remove it).
                if not self._holds(path, data):
                    self._remove_quietly(path)
            if isinstance(exc, (OSError, pa.ArrowException)):
                raise StorageError(f"writing {path} failed: {exc}") from exc
            raise

    def _holds(self, path: str, data: pa.Buffer) -> bool:
        """Whether the file at ``path`` (on a pyarrow filesystem) is exactly ``data``."""
        try:
            with self.filesystem.open_input_file(path) as f:
                return f.size() == data.size and f.read_buffer().equals(data)
        except (OSError, pa.ArrowException):
            return False

    def _write_local(self, directory: str, tmp: str, path: str, data: pa.Buffer) -> None:
        fd = -1
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
            fd, closing = -1, fd
            os.close(closing)   # released even when close reports an error: never closed twice
            os.replace(tmp, path)
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except BaseException as exc:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._remove_quietly(tmp)
            if isinstance(exc, OSError):
                raise StorageError(f"writing {path} failed: {exc}") from exc
            raise

    def _remove_quietly(self, path: str) -> bool:
        try:
            if self.local:
                os.unlink(path)
            else:
                self.filesystem.delete_file(path)
        except (OSError, pa.ArrowException):
            return False
        return True

    # ------------------------------------------------------------------ read
    def _open(self, key: str):
        path = self.path(key)
        try:
            if self.local:
                # O_NONBLOCK: a FIFO (or device) at the path must not block the open
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise IntegrityError(f"segment {key}: {path} is not a regular file")
                    return _LocalRandomAccess(fd, key)
                except BaseException:
                    os.close(fd)
                    raise
            # A FIFO (or device) at the path must not block the open: only regular files are opened.
            kind = self.filesystem.get_file_info(path).type
            if kind == pafs.FileType.NotFound:
                raise FileNotFoundError(path)
            if kind != pafs.FileType.File:
                raise IntegrityError(f"segment {key}: {path} is not a regular file")
            return _ArrowRandomAccess(self.filesystem.open_input_file(path), key)
        except FileNotFoundError as exc:
            raise SegmentNotFound(f"segment {key}: not in {self!r}") from exc
        except (OSError, pa.ArrowException) as exc:
            if not self.local and _says_not_found(exc):
                raise SegmentNotFound(f"segment {key}: not in {self!r}") from exc
            raise StorageError(f"segment {key}: cannot open {path}: {exc}") from exc

    def read_header(self, key: str) -> SegmentHeader:
        """The segment's checked metadata (not its payload), read without touching payload pages.

        Local stores reuse a parsed header while the file is the same file (same device, inode,
        size and mtime); the payload is always read and verified by its consumer.
        """
        with self._open(key) as f:
            cache = self._header_cache
            ident = f.identity
            if cache is not None:
                with self._lock:
                    hit = cache.get(key)
                    if hit is not None and hit[0] == ident:
                        cache.move_to_end(key)
                        self.stats["header_cache_hits"] += 1
                        return hit[1]
            self._count("header_reads")
            header = _read_header(f, key)
        if cache is not None:
            with self._lock:
                cache[key] = (ident, header)
                while len(cache) > _HEADER_CACHE_ENTRIES:
                    cache.popitem(last=False)
        return header

    def _read_verified(self, key: str, *, sha: bool = True, tree: bool = False) -> tuple[SegmentHeader, torch.Tensor]:
        self._count("file_reads")
        with self._open(key) as f:
            size = f.size
            head, n, offset, padded = _locate(f, key)
            image = bytearray(size)      # bounded by _locate: payload + 2 MiB at most
            image[:n] = head[:n]
            got = n + f.read_into(memoryview(image)[n:], n)
        if got != size:
            raise IntegrityError(f"segment {key}: file changed size while reading ({got} of {size} bytes)")
        header = decode_header(pa.py_buffer(image), key, payload_offset=offset, padded_length=padded)
        if header.key != key:
            raise IntegrityError(f"segment {key}: the file holds segment {header.key}")
        payload = torch.frombuffer(image, dtype=torch.uint8)[offset: offset + padded]
        check_payload(header, memoryview(image)[offset: offset + padded], sha=sha, tree=tree)
        return header, payload

    def get(self, key: str, *, model_fingerprint: ModelFingerprint, check: str = "sha256") -> Segment:
        """Read, check and return segment ``key``.

        ``check``: ``"sha256"`` (whole-object SHA-256, the default), ``"tree"`` (kmesh-tree-sha256
        root) or ``"both"``. Raises SegmentNotFound, FingerprintMismatch or IntegrityError (all
        naming the key); never returns other data than was stored.
        """
        if check not in ("sha256", "tree", "both"):
            raise ValueError(f"check: expected 'sha256', 'tree' or 'both', got {check!r}")
        header, payload = self._read_verified(key, sha=check != "tree", tree=check != "sha256")
        check_fingerprint(header, model_fingerprint)
        return segment_from_payload(header, payload)

    def verify(self, key: str) -> SegmentHeader:
        """Check everything about ``key``'s file (metadata, key, SHA-256 and tree root); returns its header."""
        header, _ = self._read_verified(key, sha=True, tree=True)
        return header

    def __contains__(self, key) -> bool:
        """Whether :meth:`keys` lists ``key`` (the same cheap test, on this one name)."""
        if not is_key(key):
            return False
        path = self.path(key)
        if self.local:
            return self._is_segment_file_local(path)
        try:
            info = self.filesystem.get_file_info(path)
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"segment {key}: cannot look up {path}: {exc}") from exc
        return self._is_segment_file_remote(info)

    # ------------------------------------------------------------------ delete / list
    def delete(self, key: str, *, missing_ok: bool = False) -> None:
        """Remove what is stored under ``key``'s name, damaged or not (SegmentNotFound if there is
        nothing, or a directory, unless ``missing_ok``; StorageError if the filesystem refuses)."""
        if missing_ok and not is_key(key):
            return
        path = self.path(key)
        if self._header_cache is not None:
            with self._lock:
                self._header_cache.pop(key, None)
        try:
            if self.local:
                os.unlink(path)
            else:
                info = self.filesystem.get_file_info(path)
                if info.type != pafs.FileType.File:
                    raise FileNotFoundError(path)
                self.filesystem.delete_file(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            if not missing_ok:
                raise SegmentNotFound(f"segment {key}: not in {self!r}") from exc
        except (OSError, pa.ArrowException) as exc:
            if not self.local and _says_not_found(exc):
                if missing_ok:
                    return
                raise SegmentNotFound(f"segment {key}: not in {self!r}") from exc
            raise StorageError(f"deleting {path} failed: {exc}") from exc

    def keys(self) -> list[str]:
        """Every stored segment key, sorted, from the directory (nothing is kept in memory).

        A key is listed when the file under its name looks like a segment file, judged cheaply from
        its first 4 KiB and last 6 bytes (two reads, no parsing): a regular file (not a symlink,
        FIFO, device or directory) ``<key>.arrow`` in the shard directory ``<key[:2]>`` (itself a
        real directory), of at least ``MIN_FILE_SIZE`` bytes, beginning with the Arrow file magic,
        naming the ``kmesh-segment`` format in its first 4 KiB (the schema), and ending with the
        Arrow file magic (a truncated or appended-to file does not). Temporaries and other junk are
        not listed; a listed file is checked in full when read (:meth:`verify` checks everything).
        On a ``pyarrow.fs`` root "regular file" is what the filesystem reports as a file.

        Raises StorageError, naming the path and the OS error, when a directory or a listed file
        cannot be read: a partial list is never returned as the whole.
        """
        if self.local:
            out = []
            for shard in self._scan_local(self._dir):
                if _is_shard_name(shard.name) and self._is_real_dir(shard):
                    out += [e.name[: -len(SUFFIX)] for e in self._scan_local(shard.path)
                            if _key_file_in_shard(e.name, shard.name)
                            and self._is_segment_file_local(e.path)]
            return sorted(out)
        depth = len([c for c in self._dir.split("/") if c]) + 2   # <dir>/<shard>/<key>.arrow, no deeper
        candidates = [i for i in self._list() if len([c for c in i.path.split("/") if c]) == depth
                      and _key_file_in_shard(i.base_name, i.path.rsplit("/", 2)[-2])]
        return sorted(i.base_name[: -len(SUFFIX)] for i in candidates if self._is_segment_file_remote(i))

    def remove_temporaries(self) -> int:
        """Delete temporary files left by writers that crashed mid-write; returns how many.

        Only safe when no writer is running on this root. StorageError when a directory cannot be
        listed; a temporary that cannot be removed is left (and not counted).
        """
        count = 0
        if self.local:
            for shard in self._scan_local(self._dir):
                if self._is_real_dir(shard):   # a symlink is not followed out of the store
                    for e in self._scan_local(shard.path):
                        if _is_temporary(e.name):
                            count += self._remove_quietly(e.path)
            return count
        for i in self._list():
            if i.type == pafs.FileType.File and _is_temporary(i.base_name):
                count += self._remove_quietly(i.path)
        return count

    def _list(self):
        try:
            return self.filesystem.get_file_info(pafs.FileSelector(self._dir, recursive=True, allow_not_found=True))
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"{self!r}: listing {self._dir} failed: {exc}") from exc

    def _scan_local(self, directory: str) -> list[os.DirEntry]:
        """The entries of a local directory (none if it is gone); StorageError if it cannot be read."""
        try:
            with os.scandir(directory) as it:
                return list(it)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StorageError(f"{self!r}: listing {directory} failed: {exc}") from exc

    def _is_real_dir(self, entry: os.DirEntry) -> bool:
        """Whether a directory entry is itself a directory (a symlink to one is not)."""
        try:
            return entry.is_dir(follow_symlinks=False)
        except OSError as exc:
            raise StorageError(f"{self!r}: cannot stat {entry.path}: {exc}") from exc

    def _is_segment_file_local(self, path: str) -> bool:
        """The cheap test of :meth:`keys` on a local path (False when nothing is there)."""
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise StorageError(f"{self!r}: cannot stat {path}: {exc}") from exc
        if not stat.S_ISREG(st.st_mode) or st.st_size < MIN_FILE_SIZE:
            return False
        try:
            # O_NOFOLLOW / O_NONBLOCK: whatever replaced the file since the lstat is not followed or waited on
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            if exc.errno == errno.ELOOP:   # now a symlink
                return False
            raise StorageError(f"{self!r}: cannot open {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < MIN_FILE_SIZE:
                return False
            head = os.pread(fd, _HEAD_PROBE, 0)
            tail = os.pread(fd, len(ARROW_MAGIC), st.st_size - len(ARROW_MAGIC))
        except OSError as exc:
            raise StorageError(f"{self!r}: cannot read {path}: {exc}") from exc
        finally:
            os.close(fd)
        return _looks_like_segment(head, tail)

    def _is_segment_file_remote(self, info: pafs.FileInfo) -> bool:
        """The cheap test of :meth:`keys` on a pyarrow.fs file (False when nothing is there)."""
        size = info.size
        if info.type != pafs.FileType.File or size is None or size < MIN_FILE_SIZE:
            return False
        n = len(ARROW_MAGIC)
        try:
            with self.filesystem.open_input_file(info.path) as f:
                head, tail = bytes(f.read_at(min(_HEAD_PROBE, size), 0)), bytes(f.read_at(n, size - n))
        except (OSError, pa.ArrowException) as exc:
            if _says_not_found(exc):   # removed since the listing
                return False
            raise StorageError(f"{self!r}: cannot read {info.path}: {exc}") from exc
        return _looks_like_segment(head, tail)


def _looks_like_segment(head: bytes, tail: bytes) -> bool:
    """keys()' test of a regular file of at least MIN_FILE_SIZE bytes, from its first 4 KiB and last 6
    (no schema parse: that would cost more than the rest of a listing; reading a segment parses it)."""
    return head.startswith(ARROW_MAGIC) and tail == ARROW_MAGIC and _FORMAT_NAME_BYTES in head


def _says_not_found(exc: BaseException) -> bool:
    # pyarrow.fs reports a missing file as an OSError whose errno may be unset (object stores)
    return isinstance(exc, FileNotFoundError) or "not found" in str(exc).lower()


def _is_shard_name(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _key_file_in_shard(name: str, shard: str) -> bool:
    """``name`` is ``<key>.arrow`` for a key that belongs in the shard directory ``shard``."""
    return name.endswith(SUFFIX) and is_key(name[: -len(SUFFIX)]) and name[:2] == shard


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


# ---------------------------------------------------------------------- file access helpers
class _LocalRandomAccess:
    def __init__(self, fd: int, name: str = "?"):
        self.fd = fd
        self.name = name
        st = os.fstat(fd)
        self.size = st.st_size
        self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        # Metadata reads must not pull payload pages into the page cache by readahead.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read_into(self, view: memoryview, offset: int) -> int:
        done = 0
        while done < len(view):
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise StorageError(f"segment {self.name}: read failed: {exc}") from exc
            if n == 0:
                break
            done += n
        return done

    def close(self):
        try:
            os.close(self.fd)
        except OSError as exc:
            raise StorageError(f"segment {self.name}: closing the file failed: {exc}") from exc

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _ArrowRandomAccess:
    def __init__(self, f, name: str = "?"):
        self.f = f
        self.name = name
        self.size = f.size()
        self.identity = None

    def read_into(self, view: memoryview, offset: int) -> int:
        try:
            data = memoryview(self.f.read_at(len(view), offset)).cast("B")
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"segment {self.name}: read failed: {exc}") from exc
        view[: len(data)] = data
        return len(data)

    def close(self):
        try:
            self.f.close()
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"segment {self.name}: closing the file failed: {exc}") from exc

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _locate(f, key: str):
    """``(head, n, payload_offset, padded_length)``: the file's first ``n`` bytes and where its payload
    lies; refuses a file with more than ``_TAIL_MAX`` bytes after the payload before anything of the
    file's size is allocated (a sparse file can claim any size)."""
    size = f.size
    probe = _HEAD_PROBE
    while True:
        head = bytearray(min(size, probe))
        n = f.read_into(memoryview(head), 0)
        try:
            offset, padded = read_schema_head(memoryview(head)[:n], key, size)
            break
        except IntegrityError:
            if probe >= min(size, _HEAD_PROBE_MAX):
                raise
            probe *= 16
    if size - (offset + padded) > _TAIL_MAX:
        raise IntegrityError(f"segment {key}: {size - offset - padded} bytes after the payload; a segment "
                             f"file has at most {_TAIL_MAX} (not a segment file, or damaged)")
    return head, n, offset, padded


def _read_header(f, key: str) -> SegmentHeader:
    """Header of an open segment file from its head and footer (the payload bytes are not read)."""
    size = f.size
    head, n, offset, padded = _locate(f, key)
    image = pa.allocate_buffer(size)
    view = memoryview(image).cast("B")
    lead = min(offset, n)
    view[:lead] = memoryview(head)[:lead]
    if lead < offset:
        f.read_into(view[lead:offset], lead)
    end = offset + padded
    if f.read_into(view[end:], end) != size - end:
        raise IntegrityError(f"segment {key}: file changed size while reading its footer")
    header = decode_header(image, key, payload_offset=offset, padded_length=padded)
    if header.key != key:
        raise IntegrityError(f"segment {key}: the file holds segment {header.key}")
    return header


def open_header(path: str, name: str) -> SegmentHeader:
    """Header of the segment file at local ``path`` (``name`` appears in errors)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise SegmentNotFound(f"segment {name}: no file {path}") from exc
    except OSError as exc:
        raise StorageError(f"segment {name}: cannot open {path}: {exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IntegrityError(f"segment {name}: {path} is not a regular file")
        f = _LocalRandomAccess(fd, name)
    except BaseException:
        os.close(fd)
        raise
    with f:
        return _read_header(f, name)


__all__ = ["SegmentStore", "open_header"]
