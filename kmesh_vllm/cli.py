"""The ``kmesh`` command: ``demo`` (main job), ``serve`` and ``status`` (cache service), ``model init``."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kmesh", description="Reuse shared KV-cache segments across requests.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the restore workload through every path and report matches")
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    d.add_argument("--preset", choices=("tiny", "qwen2.5-0.5b-shape"), default="tiny")
    d.add_argument("--model", default=None, help="HF model folder (not used by the placement demo yet)")
    d.add_argument("--children", type=int, default=4)
    d.add_argument("--segments", type=int, default=4)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", dest="json_path", default=None, help="also write the report here")

    s = sub.add_parser("serve", help="run the cache service in the foreground")
    s.add_argument("--socket", required=True, help="Unix socket path (its directory is made private)")
    s.add_argument("--store", default=None, help="segment store root (pyarrow.fs URI or path)")
    s.add_argument("--host-budget-bytes", type=int, default=1 << 30)

    st = sub.add_parser("status", help="print the service state as JSON; exit 0 when healthy")
    st.add_argument("--socket", required=True)
    st.add_argument("--timeout", type=float, default=5.0)

    m = sub.add_parser("model", help="model presets")
    msub = m.add_subparsers(dest="model_command", required=True)
    mi = msub.add_parser("init", help="write a random-weight preset as an HF model folder")
    mi.add_argument("--preset", choices=("tiny", "qwen2.5-0.5b-shape"), required=True)
    mi.add_argument("directory", help="the folder to create (must not exist, or be empty)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo_cli

        return run_demo_cli(args)
    if args.command == "serve":
        from kmesh_host.service.cli import serve_main

        return serve_main(args)
    if args.command == "status":
        from kmesh_host.service.cli import status_main

        return status_main(args)
    if args.command == "model":
        from .model import write_preset

        print(write_preset(args.preset, args.directory))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
