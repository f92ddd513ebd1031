"""``once_per_key``: ``functools.lru_cache`` whose value for a key is computed once, also when
threads ask for it at the same time.

``lru_cache`` runs a missing key's function outside its lock, so concurrent first calls each
compute the value and each caller keeps its own copy. For the device tables cached here (the
placement kernels' fp32 cos/sin table is 8 MiB for 32k positions) that means one allocation per
concurrent caller, kept alive by whatever holds it: the cache service's request threads, each
setting up a new client's first placement, made one table per thread. Here calls go through a
per-function lock; a hit costs one uncontended acquisition.
"""

from __future__ import annotations

import functools
import threading


def once_per_key(maxsize: int | None = 128):
    """Decorator: ``functools.lru_cache(maxsize)`` of the function, its calls serialised by a lock
    of its own (``cache_clear``/``cache_info`` kept). The function must not call itself."""

    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        lock = threading.Lock()

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with lock:
                return cached(*args, **kwargs)

        call.cache_clear = cached.cache_clear
        call.cache_info = cached.cache_info
        return call

    return wrap
