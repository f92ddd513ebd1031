"""A pyarrow.fs handler that keeps files in a dict: no atomic rename (move copies the bytes into the
destination in chunks, visibly, then deletes the source), optional faults per operation."""

from __future__ import annotations

import errno
import threading

import pyarrow as pa
import pyarrow.fs as pafs


class Fault(OSError):
    def __init__(self, op):
        super().__init__(errno.EIO, f"injected fault in {op}")


class DictFS(pafs.FileSystemHandler):
    """``files``: path -> bytearray (shared between handlers built on the same dict).

    ``faults``: op -> callable(path) called at the op (raise to fail); ops: "info", "list",
    "open_input", "read", "open_output", "write", "close", "move", "move_mid", "delete", "mkdir".
    ``move_chunk``: bytes per step of the non-atomic move; ``on_move_step(dest)`` runs between steps.
    """

    def __init__(self, files=None, dirs=None, *, faults=None, move_chunk=1024, on_move_step=None):
        self.files = {} if files is None else files
        self.dirs = {"/"} if dirs is None else dirs
        self.faults = {} if faults is None else faults
        self.move_chunk, self.on_move_step = move_chunk, on_move_step
        self.lock = threading.RLock()
        self.calls: dict[str, int] = {}

    def _hit(self, op, path):
        with self.lock:
            self.calls[op] = self.calls.get(op, 0) + 1
        f = self.faults.get(op)
        if f is not None:
            f(path)

    def __eq__(self, other):
        return other is self

    def __ne__(self, other):
        return other is not self

    def get_type_name(self):
        return "dictfs"

    def normalize_path(self, p):
        return p

    def _info(self, p):
        p = p.rstrip("/") or "/"
        with self.lock:
            if p in self.files:
                return pafs.FileInfo(p, pafs.FileType.File, size=len(self.files[p]))
            if p in self.dirs:
                return pafs.FileInfo(p, pafs.FileType.Directory)
        return pafs.FileInfo(p, pafs.FileType.NotFound)

    def get_file_info(self, paths):
        for p in paths:
            self._hit("info", p)
        return [self._info(p) for p in paths]

    def get_file_info_selector(self, sel):
        self._hit("list", sel.base_dir)
        base = sel.base_dir.rstrip("/")
        with self.lock:
            if base not in self.dirs:
                if sel.allow_not_found:
                    return []
                raise FileNotFoundError(errno.ENOENT, "no such directory", base)
            names = [p for p in list(self.files) + list(self.dirs) if p.startswith(base + "/")]
        out = []
        for p in names:
            rest = p[len(base) + 1:]
            if not sel.recursive and "/" in rest:
                continue
            out.append(self._info(p))
        return out

    def create_dir(self, p, recursive):
        self._hit("mkdir", p)
        p = p.rstrip("/")
        with self.lock:
            if p in self.files:
                raise FileExistsError(errno.EEXIST, "a file is in the way", p)
            parts = p.split("/")
            for i in range(2, len(parts) + 1):
                d = "/".join(parts[:i])
                if d in self.files:
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", d)
                self.dirs.add(d)

    def delete_dir(self, p):
        with self.lock:
            for q in [q for q in self.files if q.startswith(p + "/")]:
                del self.files[q]
            self.dirs -= {d for d in self.dirs if d == p or d.startswith(p + "/")}

    def delete_dir_contents(self, p, missing_dir_ok=False):
        with self.lock:
            for q in [q for q in self.files if q.startswith(p + "/")]:
                del self.files[q]
            self.dirs -= {d for d in self.dirs if d.startswith(p + "/")}

    def delete_root_dir_contents(self):
        self.delete_dir_contents("")

    def delete_file(self, p):
        self._hit("delete", p)
        with self.lock:
            if p not in self.files:
                raise FileNotFoundError(errno.ENOENT, "no such file", p)
            del self.files[p]

    def move(self, src, dest):
        """Not atomic: dest is truncated, then filled chunk by chunk (visible), then src removed."""
        self._hit("move", src)
        with self.lock:
            if src not in self.files:
                raise FileNotFoundError(errno.ENOENT, "no such file", src)
            data = bytes(self.files[src])
            self.files[dest] = bytearray()
        for i in range(0, len(data), self.move_chunk):
            if i:
                self._hit("move_mid", dest)
                if self.on_move_step is not None:
                    self.on_move_step(dest)
            with self.lock:  # a positional write, as a copy into an open file would do
                cur = self.files.setdefault(dest, bytearray())
                if len(cur) < i:
                    cur.extend(bytes(i - len(cur)))
                cur[i: i + self.move_chunk] = data[i: i + self.move_chunk]
        with self.lock:
            self.files.pop(src, None)

    def copy_file(self, src, dest):
        with self.lock:
            self.files[dest] = bytearray(self.files[src])

    def open_input_stream(self, p):
        return self.open_input_file(p)

    def open_input_file(self, p):
        self._hit("open_input", p)
        with self.lock:
            if p not in self.files:
                raise FileNotFoundError(errno.ENOENT, "no such file", p)
            data = self.files[p]  # live: a concurrent move into it is seen
        return pa.PythonFile(_Reader(self, p, data), mode="r")

    def open_output_stream(self, p, metadata):
        self._hit("open_output", p)
        with self.lock:
            d = p.rsplit("/", 1)[0]
            if d not in self.dirs:
                raise FileNotFoundError(errno.ENOENT, "no parent directory", p)
            self.files[p] = bytearray()  # visible at once, growing as written (like fsspec memory)
        return pa.PythonFile(_Writer(self, p), mode="w")

    def open_append_stream(self, p, metadata):
        raise OSError(errno.ENOTSUP, "append not supported")


class _Reader:
    def __init__(self, fs, path, data):
        self.fs, self.path, self.data, self.pos, self.closed = fs, path, data, 0, False

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else len(self.data) + pos
        return self.pos

    def tell(self):
        return self.pos

    def read(self, n=-1):
        self.fs._hit("read", self.path)
        with self.fs.lock:
            end = len(self.data) if n is None or n < 0 else self.pos + n
            out = bytes(self.data[self.pos: end])
        self.pos += len(out)
        return out

    def close(self):
        self.closed = True


class _Writer:
    def __init__(self, fs, path):
        self.fs, self.path, self.closed, self.n = fs, path, False, 0

    def writable(self):
        return True

    def write(self, b):
        b = bytes(b)
        half = b[: len(b) // 2]
        try:
            self.fs._hit("write", self.path)
        except BaseException:
            with self.fs.lock:  # a partial write lands before the failure
                self.fs.files.setdefault(self.path, bytearray()).extend(half)
            raise
        with self.fs.lock:
            self.fs.files.setdefault(self.path, bytearray()).extend(b)
        self.n += len(b)
        return len(b)

    def tell(self):
        return self.n

    def flush(self):
        pass

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.fs._hit("close", self.path)


def dict_filesystem(handler=None, **kw):
    handler = handler or DictFS(**kw)
    return pafs.PyFileSystem(handler), handler


def fail_with(exc=None):
    """A fault for ``DictFS.faults[op]``: raises ``exc`` (default: an injected :class:`Fault`)."""
    def f(path):
        raise exc if exc is not None else Fault("injected")
    return f
