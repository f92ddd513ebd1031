"""Running the cache service: in a spawned process (:class:`CacheService`) or in the foreground
(:func:`run_foreground`, ``kmesh serve``)."""

from __future__ import annotations

import os
import signal
import sys
import threading

from kmesh_gpu.errors import ServiceError

from .server import ServiceConfig, _Service


def _apply_process_settings(config: ServiceConfig) -> None:
    """What a service process sets for itself (an in-process ``_Service`` leaves its host alone)."""
    if config.switch_interval_s is not None:
        sys.setswitchinterval(config.switch_interval_s)


def _service_process_main(config: ServiceConfig, ready, stop) -> None:
    """Entry point of the spawned service process."""
    try:
        _apply_process_settings(config)
        service = _Service(config)
        service.start()
    except BaseException as exc:
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        ready.close()
        return
    ready.send(("ready", os.getpid()))
    ready.close()
    stop.wait()
    service.stop()


def run_foreground(config: ServiceConfig, *, on_ready=None) -> int:
    """Run the service in this process until SIGINT/SIGTERM (``kmesh serve``)."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _apply_process_settings(config)
        service = _Service(config)
        service.start()
        try:
            if on_ready is not None:
                on_ready(service)
            while not stop.wait(0.5):
                pass
        finally:
            service.stop()  # drains and removes the socket, after a failure too
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


class CacheService:
    """The cache service in its own spawned process; a context manager.

    ``with CacheService(ServiceConfig(socket_path=...)) as svc:`` starts it and waits until its
    socket accepts connections; leaving the block asks it to stop (it drains every pending copy
    before releasing memory), joins it with a timeout and kills it if it does not exit.
    """

    def __init__(self, config: ServiceConfig, *, start_timeout_s: float = 120.0):
        if not isinstance(config, ServiceConfig):
            raise ServiceError(f"config: expected a ServiceConfig, got {type(config).__name__}")
        self.config = config
        self.start_timeout_s = start_timeout_s
        self._proc = None
        self._stop = None

    @property
    def socket_path(self) -> str:
        return self.config.socket_path

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> "CacheService":
        import multiprocessing as mp

        if self._proc is not None:
            raise ServiceError("CacheService.start: already started")
        ctx = mp.get_context("spawn")
        receiver, sender = ctx.Pipe(duplex=False)
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_service_process_main, args=(self.config, sender, self._stop),
                                 name="kmesh-cache-service", daemon=True)
        self._proc.start()
        sender.close()
        try:
            if not receiver.poll(self.start_timeout_s):
                raise ServiceError(f"cache service did not start within {self.start_timeout_s} s")
            status, detail = receiver.recv()
        except (EOFError, OSError) as exc:
            self._proc.join(5)
            code = self._proc.exitcode
            self._kill()
            raise ServiceError(f"cache service exited during start-up (exit code {code})") from exc
        except ServiceError:
            self._kill()
            raise
        finally:
            receiver.close()
        if status != "ready":
            self._proc.join(5)
            self._kill()
            raise ServiceError(f"cache service failed to start: {detail}")
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Ask the service to drain and exit; kill it if it has not exited after ``timeout_s``."""
        if self._proc is None:
            return
        if timeout_s is None:
            timeout_s = self.config.shutdown_drain_s + 15.0
        self._stop.set()
        self._proc.join(timeout_s)
        self._kill()

    def _kill(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._proc = None

    def __enter__(self) -> "CacheService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
