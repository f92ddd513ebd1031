"""CUDA sources are compiled once per key also when threads ask for the same kernel at once (the
cache service's request threads set up new clients' first restores together)."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from kmesh_gpu import _jit


class _FakeModule:
    built = 0

    def __init__(self, **kw):
        self.kw = kw

    def compile(self):
        type(self).built += 1
        time.sleep(0.2)  # long enough for every thread to ask while the first compiles

    def get_function(self, name):
        return (self, name)


class _FakeDevice:
    def __init__(self, i):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.fixture
def fake_cupy(monkeypatch):
    cp = types.ModuleType("cupy")
    cp.RawModule = _FakeModule
    cp.cuda = types.SimpleNamespace(Device=_FakeDevice,
                                    compiler=types.SimpleNamespace(CompileException=RuntimeError))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    _FakeModule.built = 0
    yield
    _jit._module.cache_clear()
    _jit.get_kernel.cache_clear()


def test_concurrent_first_requests_compile_a_source_once(fake_cupy):
    options = (f"-DKMESH_ONCE_TEST={time.monotonic_ns()}",)  # a key nothing else has compiled
    got, barrier = [], threading.Barrier(8)

    def ask():
        barrier.wait()
        got.append(_jit.get_kernel("place.cu", "k", device_id=0, options=options))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 8 and _FakeModule.built == 1
    assert all(g is got[0] for g in got)  # one function object for every caller
    # another key is another compile
    _jit.get_kernel("place.cu", "k", device_id=1, options=options)
    assert _FakeModule.built == 2
