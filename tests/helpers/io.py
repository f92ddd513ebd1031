"""Test helpers for the O_DIRECT paths."""

from __future__ import annotations

import errno
import os


def refuse_o_direct_at_open(monkeypatch) -> None:
    """Make ``os.open`` refuse O_DIRECT with EINVAL (as filesystems without it do); other opens pass."""
    real_open = os.open

    def refusing(p, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a, **k)

    monkeypatch.setattr(os, "open", refusing)
