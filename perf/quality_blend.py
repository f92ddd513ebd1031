"""Quality of blended children against full recomputation on a real model (the quality table).

A ``document_qa`` workload (natural-language passages of generated facts, a leader holding them
all, children holding them shuffled with filler, one question each with a known answer) per seed.
Every child is run by full recomputation (the reference) and by each variant: the ``cacheblend``
policy at several ratios and ``kmesh`` policies at the 15% budget. Per variant:

* ``answer_agreement``: share of children whose greedy answer equals full recomputation's;
* ``accuracy``: share whose answer contains the known answer (full's own accuracy is its row);
* ``top1_agreement``: share of full's answer tokens that are the variant's argmax (teacher-forced);
* ``mean_kl`` / ``max_kl``: KL(full || variant) over those tokens;
* ``position_layers``: restored position-layers recomputed (the budget spent), mean per child;
* ``time_s``: median wall time per child (blend + decode).

Segments are saved and restored by the in-process restorer (segment files in a temporary store, host
staging, placement with the RoPE shift); the files' SHA-256 are checked after every child. Prints a
table, writes JSON::

    python perf/quality_blend.py --seeds 0 1 2 --json perf/out/quality_blend.json
    python perf/quality_blend.py --variants cacheblend-0.15 kmesh --seeds 0      # a subset
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # a checkout without an install

from kmesh_host import SegmentStore  # noqa: E402
from kmesh_host.restore import InProcessRestorer  # noqa: E402
from kmesh_vllm.blend import BlendConfig, Blender, answer_correct, block_tables, compare  # noqa: E402
from kmesh_vllm.model import load_model  # noqa: E402
from kmesh_vllm.workload import document_qa  # noqa: E402

CACHEBLEND = {f"cacheblend-{r}": BlendConfig(blend_recompute_ratios=(r,)) for r in (0.0, 0.15, 0.3)}
# kmesh at cacheblend-0.15's budget (recomputed position-layers of restored positions): the chosen
# default (each segment's first 8 tokens, then K+V deviation), each of its two ideas alone, a later check
KMESH = {
    "kmesh": BlendConfig(policy="kmesh"),
    "kmesh-sinks": BlendConfig(policy="kmesh", kmesh_value_weight=0.0),
    "kmesh-kv": BlendConfig(policy="kmesh", kmesh_sink_tokens=0),
    "kmesh-check2": BlendConfig(policy="kmesh", kmesh_check_layer=2),
}
VARIANTS = {**CACHEBLEND, **KMESH}


def _digests(store: SegmentStore) -> dict:
    """SHA-256 of every segment file: the originals must never change."""
    return {k: hashlib.sha256(Path(store.local_path(k)).read_bytes()).hexdigest() for k in store.keys()}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device)
    names = args.variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    rows = {n: [] for n in ["full"] + names}
    per_child = []
    for seed in args.seeds:
        workload = document_qa(model.tokenizer, chat_template=model.chat_template, children=args.children,
                               segments=args.segments, segment_tokens=args.segment_tokens,
                               prompt_tokens=args.prompt_tokens, seed=seed)
        requests = workload.requests()
        need = max(len(r) for r in requests) + args.max_new_tokens
        leader = len(workload.leader_request())
        layout = model.kv_layout(num_blocks=-(-leader // 16) + len(requests) * -(-need // 16), block_size=16)
        cache = layout.allocate(model.device, fill=0)
        store = SegmentStore(Path(tempfile.mkdtemp(prefix="kmesh-quality-")))
        restorer = InProcessRestorer(store, cache, layout, model_fingerprint=model.fingerprint, rope=model.rope)
        base = Blender(model, restorer, BlendConfig(max_new_tokens=args.max_new_tokens))
        lead_table, *tables = block_tables(layout, [leader] + [need] * len(requests))
        saved = base.save_segments(workload, lead_table)
        digests = _digests(store)
        for child in base.children(workload, saved, tables):  # every child in its own blocks, one after another
            t = time.perf_counter()
            ref = base.full(child)
            ref_s = time.perf_counter() - t
            ok = answer_correct(model.tokenizer, ref.token_ids, child.answer)
            rows["full"].append({"answer_equal": True, "top1_agreement": 1.0, "mean_kl": 0.0, "max_kl": 0.0,
                                 "correct": ok, "time_s": ref_s, "position_layers": 0})
            entry = {"seed": seed, "child": child.name, "answer": child.answer,
                     "full": model.tokenizer.decode(ref.token_ids), "variants": {}}
            for name in names:
                cfg = VARIANTS[name]
                blender = Blender(model, restorer, dataclasses.replace(cfg, max_new_tokens=args.max_new_tokens))
                t = time.perf_counter()
                out = blender.blend(child)
                dt = time.perf_counter() - t
                if out.fallback is not None:
                    raise SystemExit(f"{name} {child.name}: fell back: {out.fallback}")
                q = compare(model, ref, out)
                q.update(correct=answer_correct(model.tokenizer, out.token_ids, child.answer), time_s=dt,
                         position_layers=out.recomputed_position_layers)
                rows[name].append(q)
                entry["variants"][name] = {"text": model.tokenizer.decode(out.token_ids), **q}
            if _digests(store) != digests:
                raise SystemExit("the saved originals changed")
            per_child.append(entry)
            print(f"seed {seed} {child.name}: answer {child.answer!r}, full {entry['full']!r} "
                  + " ".join(f"{n}={int(entry['variants'][n]['answer_equal'])}" for n in names), flush=True)
        restorer.close()
        shutil.rmtree(store.root, ignore_errors=True)
    table = {}
    for name, rs in rows.items():
        judged = [r["correct"] for r in rs if r["correct"] is not None]
        table[name] = {
            "children": len(rs),
            "answer_agreement": statistics.fmean(r["answer_equal"] for r in rs),
            "accuracy": statistics.fmean(judged) if judged else None,
            "top1_agreement": statistics.fmean(r["top1_agreement"] for r in rs),
            "mean_kl": statistics.fmean(r["mean_kl"] for r in rs),
            "max_kl": max(r["max_kl"] for r in rs),
            "position_layers": statistics.fmean(r["position_layers"] for r in rs),
            "time_s": statistics.median(r["time_s"] for r in rs),
        }
    return {"model": args.model, "device": str(model.device), "machine": platform.processor() or platform.machine(),
            "threads": args.threads, "workload": {"seeds": args.seeds, "children_per_seed": args.children,
                                                  "segments": args.segments, "segment_tokens": args.segment_tokens,
                                                  "prompt_tokens": args.prompt_tokens},
            "max_new_tokens": args.max_new_tokens, "variants": {n: VARIANTS[n].__dict__ for n in names},
            "table": table, "children": per_child}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--children", type=int, default=4)
    p.add_argument("--segments", type=int, default=4)
    p.add_argument("--segment-tokens", type=int, default=104)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--variants", nargs="+", default=None, help=f"default: all of {list(VARIANTS)}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(args)
    print(f"\n{result['model']} on {result['device']}, {len(result['children'])} children "
          f"({args.prompt_tokens} tokens, {args.segments} x {args.segment_tokens}-token segments)")
    print(f"{'variant':<16} {'answer=full':>11} {'accuracy':>9} {'top1':>7} {'mean KL':>8} {'max KL':>8} "
          f"{'pos-layers':>10} {'time s':>7}")
    for name, r in result["table"].items():
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        print(f"{name:<16} {r['answer_agreement']:>11.3f} {acc:>9} {r['top1_agreement']:>7.3f} {r['mean_kl']:>8.4f} "
              f"{r['max_kl']:>8.3f} {r['position_layers']:>10.0f} {r['time_s']:>7.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
