"""Test helpers for the O_DIRECT paths: a directory whose filesystem takes O_DIRECT reads, and a
stand-in for one that refuses them."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest

#: where a test that needs O_DIRECT looks when pytest's tmp_path refuses it (tmpfs before Linux 6.6,
#: some overlay, FUSE and network filesystems): a disk-backed temporary directory, then the checkout
FALLBACK_ROOTS = ("/var/tmp", str(Path(__file__).resolve().parents[2]))


def refuse_o_direct_at_open(monkeypatch) -> None:
    """Make ``os.open`` refuse O_DIRECT with EINVAL (as filesystems without it do); other opens pass."""
    real_open = os.open

    def refusing(p, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a, **k)

    monkeypatch.setattr(os, "open", refusing)


def o_direct_refusal(directory) -> str | None:
    """Why a file in ``directory`` cannot be read with O_DIRECT, as the product reads it
    (:class:`kmesh_host.direct_io.DirectFile`: the open, then an aligned read); ``None`` when it can."""
    from kmesh_host.direct_io import ALIGN, DirectFile, HostBuffer

    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".o-direct-probe-")
    except OSError as exc:
        return exc.strerror
    try:
        os.write(fd, bytes(ALIGN))
        os.close(fd)
        with DirectFile(path) as f, HostBuffer(ALIGN) as buf:
            f.pread_into(buf.view, 0)
            return None if f.o_direct else f.fallback_reason
    finally:
        os.unlink(path)


@contextlib.contextmanager
def o_direct_dir(tmp_path: Path):
    """A directory whose files are read with O_DIRECT: ``tmp_path`` where its filesystem allows it,
    else a fresh one under :data:`FALLBACK_ROOTS` (removed afterwards); skips the test, naming each
    refusal, where none does."""
    why = o_direct_refusal(tmp_path)
    if why is None:
        yield tmp_path
        return
    refusals = [f"tmp_path: {why}"]
    for root in FALLBACK_ROOTS:
        if not os.path.isdir(root) or not os.access(root, os.W_OK):
            continue
        d = tempfile.mkdtemp(dir=root, prefix=".kmesh-o-direct-")
        try:
            why = o_direct_refusal(d)
            if why is None:
                yield Path(d)
                return
            refusals.append(f"{root}: {why}")
        finally:
            shutil.rmtree(d, ignore_errors=True)
    pytest.skip(f"needs a filesystem that takes O_DIRECT reads; here {'; '.join(refusals)}")
