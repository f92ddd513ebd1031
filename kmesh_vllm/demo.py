"""``kmesh demo``: the restore workload of seed §24 on synthetic segments, through every path.

A leader computes K/V for ``segments`` shared text segments (416 tokens in all for four segments) at
its own positions. The segments are saved to a :class:`kmesh_host.SegmentStore` (Arrow files with
SHA-256 and tree digests). Each of ``children`` children has a 512-token prompt that places the
segments at other positions after other text: it restores them from the store into its own paged
cache (vLLM layout), shifting keys to the new positions, with every available backend, one child at a
time and all children in one batched launch. The report says what matched:

* all backends and both schedules, and the cache service (a spawned process that reads the
  segments from the same store and restores each child into the registered cache: shared memory
  on CPU, CUDA IPC on a GPU), give identical bits (``kv_max_abs_diff`` = 0.0 is required);
* shifted keys equal keys rotated directly at the new position within the model dtype's rounding
  (``shift_vs_direct_max_abs_diff``; exact equality is not expected, see DESIGN §2);
* values arrive bit for bit, and nothing outside each child's slots changes;
* failure controls: corrupt file, missing segment, wrong model fingerprint, out-of-range block ids.

The model-side fields (``logits_max_abs_diff``, ``tokens_equal``, ``recompute_choices_*``) are
``null`` until the blender and model harness exist; the placement demo reports what it measured.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kmesh_gpu import KmeshError, KVLayout, LayoutError, RopeSpec, _backend, gather, place, place_many


@dataclass(frozen=True)
class Preset:
    num_layers: int
    num_kv_heads: int
    head_size: int
    rope_theta: float
    dtype: torch.dtype
    block_size: int = 16
    max_position: int = 32768


PRESETS = {
    "tiny": Preset(num_layers=4, num_kv_heads=2, head_size=64, rope_theta=1e6, dtype=torch.bfloat16),
    "qwen2.5-0.5b-shape": Preset(num_layers=24, num_kv_heads=2, head_size=64, rope_theta=1e6, dtype=torch.bfloat16),
}
SEGMENT_TOKENS = 104  # 4 x 104 = 416 shared tokens, as in the seed
PROMPT_TOKENS = 512


def _plan_children(n_children: int, seg_lens: list[int], gen: torch.Generator):
    """Per child: the prompt position where each segment starts (segments in a random order with
    other text between them), all inside a 512-token prompt."""
    plans = []
    shared = sum(seg_lens)
    free = PROMPT_TOKENS - shared
    for _ in range(n_children):
        order = torch.randperm(len(seg_lens), generator=gen).tolist()
        gaps = torch.rand(len(seg_lens) + 1, generator=gen)
        gaps = (gaps / gaps.sum() * free).floor().long().tolist()
        starts, pos = {}, gaps[0]
        for k, s in enumerate(order):
            starts[s] = pos
            pos += seg_lens[s] + gaps[k + 1]
        plans.append(starts)
    return plans


def run_demo(*, device: str = "cpu", preset: str = "tiny", children: int = 4, segments: int = 4, seed: int = 0,
             store_root: str | None = None, service: bool = True) -> dict:
    from kmesh_host import FingerprintMismatch, IntegrityError, SegmentNotFound, SegmentStore
    from kmesh_host.segment import ModelFingerprint

    p = PRESETS[preset]
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    rope = RopeSpec(p.head_size, p.head_size, p.rope_theta, True, p.max_position, p.dtype)
    fingerprint = ModelFingerprint(architecture=f"synthetic-{preset}", num_layers=p.num_layers,
                                   num_kv_heads=p.num_kv_heads, head_size=p.head_size,
                                   dtype=str(p.dtype).removeprefix("torch."), rope=rope.to_dict())
    L, H, D = p.num_layers, p.num_kv_heads, p.head_size
    seg_lens = [SEGMENT_TOKENS] * segments
    timings: dict[str, float] = {}

    # ---- leader: K/V of the shared segments at the leader's positions, saved to the store
    leader_pos, pos = [], 7
    raw = []
    for n in seg_lens:
        leader_pos.append(torch.arange(pos, pos + n, dtype=torch.int64))
        pos += n + 11
        raw.append(torch.randn(2, L, n, H, D, generator=gen).to(dev))
    tmp = tempfile.TemporaryDirectory(prefix="kmesh-demo-") if store_root is None else None
    root = Path(store_root or tmp.name)
    store = SegmentStore(str(root))
    keys = []
    t0 = time.perf_counter()
    for s, n in enumerate(seg_lens):
        k = rope.apply(raw[s][0].float(), leader_pos[s].to(dev)).to(p.dtype)
        kv = torch.stack((k, raw[s][1].to(p.dtype)))
        token_ids = torch.randint(0, 32000, (n,), generator=gen)
        keys.append(store.put(kv.cpu(), token_ids, leader_pos[s], model_fingerprint=fingerprint))
    timings["save_ms"] = (time.perf_counter() - t0) * 1e3

    # ---- children: restore into private paged caches at new positions
    plans = _plan_children(children, seg_lens, gen)
    blocks_per_child = PROMPT_TOKENS // p.block_size
    layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=blocks_per_child * children + 4,
                                block_size=p.block_size, num_kv_heads=H, head_size=D, dtype=p.dtype)
    backends = ["torch"] + (["warp"] if _backend.has_warp() else []) + \
        (["cupy"] if dev.type == "cuda" and _backend.has_cupy() else [])
    # each child's block table: a random set of blocks of the shared cache (vLLM's allocator view)
    block_perm = torch.randperm(layout.num_blocks, generator=gen)
    block_tables = [block_perm[c * blocks_per_child:(c + 1) * blocks_per_child] for c in range(children)]

    def slot_mapping(c: int, prompt_pos: torch.Tensor) -> torch.Tensor:
        bt = block_tables[c]
        return bt[prompt_pos // p.block_size] * p.block_size + prompt_pos % p.block_size

    t0 = time.perf_counter()
    restored = [store.get(k, model_fingerprint=fingerprint) for k in keys]
    timings["restore_from_store_ms"] = (time.perf_counter() - t0) * 1e3
    seg_kv = [r.kv.to(dev) for r in restored]

    work = []  # (child, segment, slots, old, new)
    for c, starts in enumerate(plans):
        for s, n in enumerate(seg_lens):
            new = torch.arange(starts[s], starts[s] + n, dtype=torch.int64)
            work.append((c, s, slot_mapping(c, new).to(dev), restored[s].positions.to(dev), new.to(dev)))

    results = {}
    poison = 0.125
    for backend in backends:
        # serial: one placement per (child, segment)
        cache = layout.allocate(dev, fill=poison)
        _sync(dev)
        t0 = time.perf_counter()
        for c, s, slots, old, new in work:
            place(seg_kv[s], cache, layout, slots, rope=rope, old_positions=old, new_positions=new, backend=backend)
        _sync(dev)
        timings[f"serial_place_ms[{backend}]"] = (time.perf_counter() - t0) * 1e3
        results[(backend, "serial")] = cache
        # grouped: all children, all segments, one launch
        cache = layout.allocate(dev, fill=poison)
        _sync(dev)
        t0 = time.perf_counter()
        place_many([seg_kv[s] for _, s, *_ in work], cache, layout, [w[2] for w in work], rope=rope,
                   old_positions=[w[3] for w in work], new_positions=[w[4] for w in work], backend=backend)
        _sync(dev)
        timings[f"batched_place_ms[{backend}]"] = (time.perf_counter() - t0) * 1e3
        results[(backend, "batched")] = cache

    if service:  # the same children through the cache service, from the same store
        t0 = time.perf_counter()
        whole, layers = _through_service(root, layout, rope, fingerprint, keys, work, children, poison, dev, timings)
        results[("service", "store")] = whole
        results[("service", "per-layer")] = layers
        timings["service_total_ms"] = (time.perf_counter() - t0) * 1e3

    ref = results[("torch", "serial")]
    kv_max_abs_diff = max(float((r.float() - ref.float()).abs().max()) for r in results.values())
    bits_equal = all(torch.equal(r.view(torch.int16), ref.view(torch.int16)) for r in results.values())

    # shifted keys vs direct rotation at the new positions; V bit for bit; untouched slots keep poison
    shift_diff, v_equal = 0.0, True
    used = torch.zeros(layout.num_slots, dtype=torch.bool)
    for c, s, slots, old, new in work:
        back = gather(ref, layout, slots)
        direct = rope.apply(raw[s][0].float(), new).to(p.dtype)
        shift_diff = max(shift_diff, float((back[0].float() - direct.float()).abs().max()))
        v_equal &= torch.equal(back[1], seg_kv[s][1])
        used[slots.cpu()] = True
    untouched_ok = _untouched(ref, layout, used, poison)

    controls = _failure_controls(store, keys, fingerprint, root, seg_kv[0], layout, rope, dev,
                                 (FingerprintMismatch, IntegrityError, SegmentNotFound, LayoutError, KmeshError))
    report = {
        "device": device, "preset": preset, "children": children, "segments": segments,
        "layers": L, "kv_heads": H, "head_size": D, "dtype": str(p.dtype).removeprefix("torch."),
        "shared_tokens": sum(seg_lens), "prompt_tokens": PROMPT_TOKENS, "layout": layout.name,
        "backends": backends, "placements": len(work),
        "comparisons": {
            "kv_max_abs_diff": kv_max_abs_diff,
            "kv_bits_equal_across_paths": bits_equal,
            "paths_compared": [f"{b}/{m}" for b, m in results],
            "shift_vs_direct_max_abs_diff": shift_diff,
            "values_bit_exact": bool(v_equal),
            "untouched_slots_unchanged": bool(untouched_ok),
            "logits_max_abs_diff": None,
            "tokens_equal": None,
            "recompute_choices_equal": None,
            "recompute_choices_total": children * L,
        },
        "failure_controls": controls,
        "quality": {"note": "model quality needs the blender; this demo checks placement, shift and integrity"},
        "timings": timings,
    }
    if tmp is not None:
        tmp.cleanup()
    return report


def _through_service(root: Path, layout: KVLayout, rope: RopeSpec, fingerprint, keys, work, children: int,
                     poison: float, dev: torch.device, timings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Start a cache service on the demo's store and restore each child through it with one request of
    its segments (the service reads them from the store, checks the model fingerprint and shifts
    the keys), twice: into one registered allocation, and into one allocation per layer (as vLLM
    holds its caches). Shared memory on CPU, the CUDA tensors themselves on a GPU. Returns both
    caches' contents (the per-layer one stacked into the whole cache's shape)."""
    from kmesh_host.restore import RestoreItem, ServiceRestorer
    from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache

    view = layout.per_layer()

    def allocate(lay):
        shared = SharedCache(lay, fill=0) if dev.type == "cpu" else None
        tensor = shared.tensor if shared is not None else lay.allocate(dev)
        tensor.view(lay.storage_dtype).fill_(poison)  # as layout.allocate(fill=poison)
        return shared, tensor

    with tempfile.TemporaryDirectory(prefix="kms-") as d:
        cfg = ServiceConfig(socket_path=str(Path(d) / "svc" / "kmesh.sock"), store_root=str(root))
        with CacheService(cfg) as svc, CacheClient(svc.socket_path) as client:
            allocations = [allocate(layout)] + [allocate(view) for _ in range(layout.num_layers)]
            part = objs = None  # views of the shared segments, dropped before they close
            try:
                outs = []
                for name, part in (("whole", allocations[:1]), ("per_layer", allocations[1:])):
                    objs = [shared if shared is not None else tensor for shared, tensor in part]
                    with ServiceRestorer(client, objs[0] if name == "whole" else objs, layout,
                                         model_fingerprint=fingerprint, rope=rope) as restorer:
                        t0 = time.perf_counter()
                        for c in range(children):
                            restorer.restore([RestoreItem(keys[s], slots.cpu(), new.cpu())
                                              for cc, s, slots, _, new in work if cc == c])
                        timings[f"service_restore_ms[{name}]"] = (time.perf_counter() - t0) * 1e3
                    outs.append(part[0][1].clone() if name == "whole" else
                                torch.stack([tensor for _, tensor in part]).reshape(layout.physical_shape))
            finally:
                del part, objs
                for shared, _ in allocations:
                    if shared is not None:
                        shared.close()
                del allocations
    return outs[0], outs[1]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _untouched(cache: torch.Tensor, layout: KVLayout, used: torch.Tensor, poison: float) -> bool:
    # every slot no placement addressed must still hold the poison in all layers, heads and dims
    L, B, H, N, D = layout.sizes
    view = cache.view(L, B, H, N, 2 * D).permute(1, 3, 0, 2, 4).reshape(B * N, -1).cpu()
    return bool((view[~used] == poison).all())


def _failure_controls(store, keys, fingerprint, root: Path, kv, layout, rope, dev, errors) -> dict:
    from kmesh_host.segment import ModelFingerprint

    FingerprintMismatch, IntegrityError, SegmentNotFound, LayoutError_, KmeshError_ = errors
    checks = []

    def expect(name: str, exc_type, fn):
        try:
            fn()
        except exc_type as exc:
            checks.append({"name": name, "passed": True, "error": f"{type(exc).__name__}: {exc}"[:200]})
            return
        except Exception as exc:  # a wrong error type is a failed control, reported, not raised
            checks.append({"name": name, "passed": False, "error": f"unexpected {type(exc).__name__}: {exc}"[:200]})
            return
        checks.append({"name": name, "passed": False, "error": "no error raised"})

    other = ModelFingerprint(architecture=fingerprint.architecture, num_layers=fingerprint.num_layers,
                             num_kv_heads=fingerprint.num_kv_heads, head_size=fingerprint.head_size,
                             dtype="float16", rope=fingerprint.rope)
    expect("wrong model fingerprint", FingerprintMismatch, lambda: store.get(keys[0], model_fingerprint=other))
    expect("missing segment", SegmentNotFound, lambda: store.get("0" * 64, model_fingerprint=fingerprint))
    # corrupt one byte in the middle of a stored file, then read it
    files = sorted(p for p in root.rglob("*") if p.is_file() and keys[1] in p.name)
    if files:
        data = bytearray(files[0].read_bytes())
        data[len(data) // 2] ^= 0x40
        files[0].write_bytes(bytes(data))
        expect("corrupt segment file", IntegrityError, lambda: store.get(keys[1], model_fingerprint=fingerprint))
    else:
        checks.append({"name": "corrupt segment file", "passed": False, "error": "segment file not found on disk"})
    cache = layout.allocate(dev, fill=0)
    T = kv.shape[2]
    bad_slots = torch.arange(T, dtype=torch.int64, device=dev) + layout.num_slots - T // 2
    expect("out-of-range block ids", LayoutError_, lambda: place(kv, cache, layout, bad_slots))
    bad_pos = torch.full((T,), rope.num_positions, dtype=torch.int64, device=dev)
    expect("position past max_position", LayoutError_,
           lambda: place(kv, cache, layout, torch.arange(T, device=dev), rope=rope,
                         old_positions=bad_pos, new_positions=bad_pos))
    untouched = bool((cache == 0).all())
    checks.append({"name": "failed placements wrote nothing", "passed": untouched, "error": None})
    return {"passed": sum(c["passed"] for c in checks), "total": len(checks), "checks": checks}


def _print(report: dict) -> None:
    c = report["comparisons"]
    print(f"KMesh restore demo — {report['children']} children x {report['segments']} segments "
          f"({report['shared_tokens']} shared tokens in {report['prompt_tokens']}-token prompts), "
          f"{report['layers']} layers, {report['dtype']}, {report['layout']} on {report['device']}")
    print(f"  paths: {', '.join(c['paths_compared'])}")
    print(f"  identical bits across paths : {c['kv_bits_equal_across_paths']} (max abs diff {c['kv_max_abs_diff']})")
    print(f"  values bit exact            : {c['values_bit_exact']}")
    print(f"  untouched slots unchanged   : {c['untouched_slots_unchanged']}")
    print(f"  shift vs direct rotation    : max abs diff {c['shift_vs_direct_max_abs_diff']:.4g} "
          f"(model-dtype rounding; not required to be 0)")
    fc = report["failure_controls"]
    print(f"  failure controls            : {fc['passed']}/{fc['total']} passed")
    for chk in fc["checks"]:
        print(f"    [{'ok' if chk['passed'] else 'FAIL'}] {chk['name']}: {chk['error']}")
    for k, v in report["timings"].items():
        print(f"  {k:32s}: {v:9.2f}")


def run_demo_cli(args) -> int:
    if args.model is not None:
        print("kmesh demo: --model is used by the model workload (blender), not by the placement demo",
              flush=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kmesh demo: --device cuda requested but no CUDA device is available")
        return 2
    report = run_demo(device=args.device, preset=args.preset, children=args.children, segments=args.segments,
                      seed=args.seed)
    _print(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    c = report["comparisons"]
    ok = (c["kv_bits_equal_across_paths"] and c["values_bit_exact"] and c["untouched_slots_unchanged"]
          and report["failure_controls"]["passed"] == report["failure_controls"]["total"])
    return 0 if ok else 1
