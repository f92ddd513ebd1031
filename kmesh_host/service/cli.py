"""``kmesh serve`` and ``kmesh status`` (dispatched from ``kmesh_vllm.cli``)."""

from __future__ import annotations

import json
import os
import sys

from kmesh_gpu.errors import KmeshError


def serve_main(args) -> int:
    """Run the cache service in the foreground until SIGINT/SIGTERM. Args: ``socket``, ``store`` (the
    segment store of the originals; ``None``: a private one beside the socket, removed at exit),
    ``host_budget_bytes`` (the host tier's)."""
    from .process import run_foreground
    from .server import ServiceConfig

    config = ServiceConfig(socket_path=args.socket, store_root=args.store, host_budget_bytes=args.host_budget_bytes)

    def ready(service):
        print(f"kmesh serve: listening on {config.socket_path} (pid {os.getpid()}), originals in "
              f"{service.originals.store.root}", file=sys.stderr, flush=True)

    try:
        return run_foreground(config, on_ready=ready)
    except KmeshError as exc:
        print(f"kmesh serve: {exc}", file=sys.stderr)
        return 1


def status_main(args) -> int:
    """Print the service state as JSON; exit 0 when it answers and reports itself healthy, 1 otherwise."""
    from .client import CacheClient

    try:
        with CacheClient(args.socket, timeout=args.timeout) as client:
            state = client.status()
    except (KmeshError, OSError) as exc:
        print(json.dumps({"healthy": False, "socket": args.socket, "error": str(exc)}, indent=2))
        return 1
    print(json.dumps(state, indent=2, sort_keys=True))
    return 0 if state.get("healthy") is True else 1
