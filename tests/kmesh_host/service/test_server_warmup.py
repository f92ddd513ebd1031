"""The service compiles (or loads) its compiled paths as it starts, on a thread of its own, and a
registration that comes before that has finished waits for it instead of compiling in parallel."""

from __future__ import annotations

import itertools
import os
import threading

import pytest

from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache
from kmesh_host.service import server as server_mod
from tests.kmesh_host.service.helpers import fingerprint, small_layout, socket_dir, wait_for


def test_registration_waits_for_the_start_up_warm_up(monkeypatch):
    """The warm-up (a cold compile) is held until a registration is seen waiting for it: that
    registration's own call to the compiled paths comes only after the warm-up's has returned."""
    real = server_mod._compiled.compiled
    order = itertools.count()
    calls = []  # (thread name, step entered, step left)
    waiting, compile_done = threading.Event(), threading.Event()

    def slow_compiled():
        entered = next(order)
        if threading.current_thread().name == "kmesh-warmup":
            assert compile_done.wait(60)  # a cold compile, until a registration waits for it
        out = real()
        calls.append((threading.current_thread().name, entered, next(order)))
        return out

    class WatchedEvent(threading.Event):
        def wait(self, timeout=None):
            waiting.set()
            return super().wait(timeout)

    monkeypatch.setattr(server_mod._compiled, "compiled", slow_compiled)
    releaser = threading.Thread(target=lambda: waiting.wait(60) and compile_done.set(), daemon=True)
    with socket_dir() as d:
        svc = server_mod._Service(ServiceConfig(socket_path=os.path.join(d, "s", "k.sock")))
        svc._warm = WatchedEvent()
        svc.start()
        releaser.start()
        try:
            with CacheClient(svc.config.socket_path, timeout=120) as client:
                assert client.status()["warm"] is False  # the warm-up is still compiling
                layout = small_layout()
                with SharedCache(layout, fill=0) as cache:
                    reg = client.register(cache, layout, model_fingerprint=fingerprint())
                    registered = next(order)
                    status = client.status()
                    assert client.close_registration(reg) is True
        finally:
            compile_done.set()
            svc.stop()
            releaser.join(60)
    warm = [c for c in calls if c[0] == "kmesh-warmup"]
    others = [c for c in calls if c[0] != "kmesh-warmup"]
    assert waiting.is_set() and len(warm) == 1 and warm[0][2] < registered
    # the registration's own call came after the warm-up had finished (it waited, it did not compile alongside)
    assert others and all(entered > warm[0][2] for _, entered, _ in others)
    assert status["warm"] is True and status["warm_up_s"] >= 0


def test_a_spawned_service_reports_itself_warm():
    with socket_dir() as d, CacheService(ServiceConfig(socket_path=os.path.join(d, "s", "k.sock"))) as svc:
        with CacheClient(svc.socket_path, timeout=30) as client:
            status = wait_for(lambda: (s := client.status())["warm"] and s, timeout=120)
            assert status["healthy"] is True and status["warm_up_s"] >= 0


@pytest.mark.parametrize("fails", ["compiled", "warm_up"])
def test_a_failing_warm_up_still_lets_registrations_through(monkeypatch, fails, capfd):
    def boom():
        if threading.current_thread().name == "kmesh-warmup":
            raise RuntimeError("injected warm-up failure")
        return None

    target = server_mod._compiled if fails == "compiled" else server_mod.cuda
    monkeypatch.setattr(target, fails, boom)
    with socket_dir() as d:
        svc = server_mod._Service(ServiceConfig(socket_path=os.path.join(d, "s", "k.sock")))
        svc.cuda = fails == "warm_up"  # the driver calls are warmed only where CUDA is
        svc.start()
        try:
            assert svc._warm.wait(30)
            if fails == "compiled":  # a CPU registration runs the compiled paths' fallback
                with CacheClient(svc.config.socket_path, timeout=30) as client:
                    layout = small_layout()
                    with SharedCache(layout, fill=0) as cache:
                        reg = client.register(cache, layout, model_fingerprint=fingerprint())
                        assert client.close_registration(reg) is True
        finally:
            svc.stop()
    assert "injected warm-up failure" in capfd.readouterr().err
