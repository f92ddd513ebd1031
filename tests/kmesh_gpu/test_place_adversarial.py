"""Adversarial checks of the public placement API on the CPU (torch and Warp backends; CuPy needs
CUDA and is not run here).

* Seeded random cases over every layout string ``from_vllm`` accepts (both packings), the legacy
  shapes and a padded custom layout; block sizes 1/16/odd, head sizes 64/80/128, partial rotary
  dims, neox and GPT-J pairing, fp32/fp16/bf16 and fp8: torch equals an independent reference bit
  for bit, Warp equals torch, place_many equals place, gather inverts an unshifted place, and a
  shifted place writes exactly ``rope_shift`` of the keys.
* Bad input: every refusal is a typed :class:`KmeshError` naming the argument, and the whole cache
  (every cache of the call) is unchanged bit for bit afterwards.
* KVLayout / RopeSpec construction, descriptions and round trips.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from kmesh_gpu import (BackendError, KmeshError, KVLayout, LayoutError, RopeSpec, gather, place, place_many,
                       rope_shift)
from kmesh_gpu.layout import VLLM_ALIASES, VLLM_LAYOUTS
from tests.helpers.kvref import Case, build, reference_place

BACKENDS = ["torch", "warp"]  # the CPU backends; "cupy" needs CUDA tensors (refused on CPU, tested below)
POISON = 0xA5
MAXPOS = 4096


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


# ================================================================================ random grid
_NAMES = list(VLLM_LAYOUTS) + list(VLLM_ALIASES)
_VARIANTS = ([("named", n) for n in _NAMES] + [("planes", n) for n in _NAMES]
             + [("legacy", f"{a}/{o}") for a in ("first", "second") for o in ("NHD", "HND")] + [("padded", "custom")])
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}


def _grid(seed: int = 20240611, per_variant: int = 2):
    rng = random.Random(seed)
    cases = []
    for kind, name in _VARIANTS:
        for _ in range(per_variant):
            D = rng.choice([64, 80, 128])
            rd = rng.choice([D, D // 2, D - 16, 24, None])  # None: no shift (a plain copy)
            cases.append(dict(kind=kind, name=name, N=rng.choice([1, 16, 5, 7]), D=D, rd=rd,
                              neox=rng.random() < 0.5, dtype=rng.choice(list(_DTYPES)), seed=rng.randrange(1 << 30)))
    # make sure every value of every axis occurs (the draw is seeded; this guards edits of it)
    for key, values in (("N", [1, 16, 5, 7]), ("D", [64, 80, 128]), ("dtype", list(_DTYPES)), ("neox", [True, False])):
        for v, c in zip(values, [c for c in cases if c["rd"] is not None][:len(values)]):
            if not any(x[key] == v and x["rd"] is not None for x in cases):
                c[key] = v
    if not any(c["rd"] is not None and c["rd"] < c["D"] for c in cases):
        cases[0]["rd"] = cases[0]["D"] // 2
    return cases


GRID = _grid()


def _case_layout(c, L, B, H):
    """(layout, views) for a grid case; views(cache) -> logical K, V from kvref (independent of strides)."""
    dtype = _DTYPES[c["dtype"]]
    if c["kind"] in ("named", "planes"):
        canonical = VLLM_ALIASES.get(c["name"], c["name"])
        ref_layout, views = build(Case(c["kind"], canonical), L=L, B=B, H=H, N=c["N"], D=c["D"], dtype=dtype)
        layout = KVLayout.from_vllm(c["name"], num_layers=L, num_blocks=B, block_size=c["N"], num_kv_heads=H,
                                    head_size=c["D"], dtype=dtype, kv_packing="content" if c["kind"] == "named"
                                    else "planes")
        assert layout == ref_layout  # an alias is its canonical layout
        return layout, views
    return build(Case(c["kind"], c["name"]), L=L, B=B, H=H, N=c["N"], D=c["D"], dtype=dtype)


def _case_inputs(c, layout, T):
    gen = torch.Generator().manual_seed(c["seed"])
    L, _, H, _, D = layout.sizes
    x = torch.randn(2, L, T, H, D, generator=gen) * 2
    kv = x.to(torch.float8_e4m3fn).view(torch.uint8) if c["dtype"] == "fp8" else x.to(_DTYPES[c["dtype"]])
    slots = torch.randperm(layout.num_slots, generator=gen)[:T].to(torch.int64)
    slots[T // 3] = -1
    slots[-1] = -1
    old = torch.randint(0, MAXPOS, (T,), generator=gen)
    new = torch.randint(0, MAXPOS, (T,), generator=gen)
    old[T // 3] = MAXPOS + 7  # the skipped token's positions are never read: accepted
    rope = None
    if c["rd"] is not None:
        model = torch.bfloat16 if c["dtype"] == "fp8" else _DTYPES[c["dtype"]]
        rope = RopeSpec(D, c["rd"], 10000.0, c["neox"], MAXPOS, model)
    k_scale = None
    if c["dtype"] == "fp8" and rope is not None:
        k_scale = [0.5, 1.75][c["seed"] % 2]
    return kv, slots, old, new, rope, k_scale


@pytest.mark.parametrize("c", GRID, ids=[f"{c['kind']}-{c['name'].replace('/', '-')}-N{c['N']}-D{c['D']}-"
                                         f"rd{c['rd']}-{'neox' if c['neox'] else 'gptj'}-{c['dtype']}-{i}"
                                         for i, c in enumerate(GRID)])
def test_backends_match_reference_on_random_cases(c):
    L, H, T = 2, 2, 13
    B = max(3, -(-(T + 4) // c["N"]))
    layout, views = _case_layout(c, L, B, H)
    kv, slots, old, new, rope, k_scale = _case_inputs(c, layout, T)
    kw = dict(rope=rope, old_positions=old, new_positions=new) if rope is not None else {}
    base = layout.allocate(fill=POISON)
    expected = _bits(reference_place(base, views, kv, slots.clone(), N=c["N"], rope=rope, old=old.clamp(max=MAXPOS - 1),
                                     new=new, k_scale=k_scale or 1.0))
    valid = slots >= 0
    for backend in BACKENDS:
        cache = layout.allocate(fill=POISON)
        place(kv, cache, layout, slots, k_scale=k_scale, backend=backend, **kw)
        assert torch.equal(_bits(cache), expected), f"{backend}: {(_bits(cache) != expected).sum()} bytes differ"
        # place_many over three items (one of them empty) into the one cache: the same bits
        cut = [0, 4, 4, T]
        many = layout.allocate(fill=POISON)
        part = lambda t, i: t[..., cut[i]:cut[i + 1]].contiguous()  # noqa: E731
        mkw = {}
        if rope is not None:
            mkw = dict(rope=rope, old_positions=[part(old, i) for i in range(3)],
                       new_positions=[part(new, i) for i in range(3)])
        place_many([kv[:, :, cut[i]:cut[i + 1]].contiguous() for i in range(3)], many, layout,
                   [part(slots, i) for i in range(3)], k_scale=k_scale, backend=backend, **mkw)
        assert torch.equal(_bits(many), expected), f"{backend}: place_many differs from place"
        back = gather(cache, layout, slots, backend=backend)
        assert not bool(_bits(back)[:, :, ~valid].any())  # skipped tokens come back as zeros
        assert torch.equal(_bits(back[1][:, valid]), _bits(kv[1][:, valid]))  # V copied bit for bit
        if rope is None:
            assert torch.equal(_bits(back[0][:, valid]), _bits(kv[0][:, valid]))  # gather inverts place
        elif c["dtype"] != "fp8":  # K is exactly rope_shift of the keys (same fp32 order, one rounding)
            want = rope_shift(kv[0][:, valid], old[valid], new[valid], rope)
            assert torch.equal(_bits(back[0][:, valid]), _bits(want))


def test_grid_covers_every_axis():
    shifted = [c for c in GRID if c["rd"] is not None]
    assert {c["N"] for c in GRID} == {1, 16, 5, 7}
    assert {c["D"] for c in GRID} == {64, 80, 128}
    assert {c["dtype"] for c in shifted} == set(_DTYPES)
    assert {c["neox"] for c in shifted} == {True, False}
    assert any(c["rd"] < c["D"] for c in shifted) and any(c["rd"] is None for c in GRID)
    assert {(c["kind"], c["name"]) for c in GRID} == set(_VARIANTS)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_warp_equals_torch_on_extreme_finite_values(dtype, neox):
    """Keys from tiny (subnormal) to large, signed zeros; positions at both ends of the table. Warp
    and torch agree bit for bit (fp16: up to its largest value, so that results round to infinity;
    fp32/bf16: up to max/8, so that the fp32 rotation itself cannot overflow into inf - inf)."""
    dt = _DTYPES[dtype]
    T, H, D = 64, 2, 64
    layout = KVLayout.from_vllm("BLNHC", num_layers=1, num_blocks=T // 16, block_size=16, num_kv_heads=H,
                                head_size=D, dtype=dt)
    rope = RopeSpec(D, 48, 500000.0, neox, MAXPOS, dt)
    gen = torch.Generator().manual_seed(4)
    info = torch.finfo(dt)
    top = info.max if dt == torch.float16 else info.max / 8
    x = torch.randn(2, 1, T, H, D, generator=gen) * torch.exp(torch.randn(2, 1, T, H, D, generator=gen) * 6)
    x = x.clamp(-top, top)
    x.view(-1)[:6] = torch.tensor([-0.0, 0.0, top, -top, info.tiny, info.tiny / 8])
    kv = x.to(dt)
    assert bool(torch.isfinite(kv.float()).all())
    old = torch.randint(0, MAXPOS, (T,), generator=gen)
    new = torch.randint(0, MAXPOS, (T,), generator=gen)
    old[:2], new[:2] = torch.tensor([0, MAXPOS - 1]), torch.tensor([MAXPOS - 1, 0])
    slots = torch.randperm(T, generator=gen)
    outs = []
    for backend in BACKENDS:
        cache = layout.allocate(fill=POISON)
        place(kv, cache, layout, slots, rope=rope, old_positions=old, new_positions=new, backend=backend)
        outs.append(_bits(cache))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("k_scale", [None, 1e-3, 0.37, 3.0, [0.5, 2.0]])
def test_fp8_shift_warp_equals_torch_for_every_finite_byte(k_scale):
    """Every finite fp8 e4m3 bit pattern as a key (NaN excluded), several scales: same bytes."""
    L, H, D = 2, 1, 16
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 254 finite codes
    T = 32
    reps = -(-(2 * L * T * H * D) // codes.numel())
    kv = codes.repeat(reps)[:2 * L * T * H * D].view(2, L, T, H, D).contiguous()
    layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=4, block_size=8, num_kv_heads=H, head_size=D,
                                dtype=torch.uint8)
    rope = RopeSpec(D, D, 10000.0, True, 256, torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    old, new = torch.randint(0, 256, (T,), generator=gen), torch.randint(0, 256, (T,), generator=gen)
    outs = []
    for backend in BACKENDS:
        cache = layout.allocate(fill=0)
        place(kv, cache, layout, torch.arange(T), rope=rope, old_positions=old, new_positions=new, k_scale=k_scale,
              backend=backend)
        outs.append(cache)
        # float8_e4m3fn tensors are the same bytes as uint8 ones
        cache8 = layout.allocate(fill=0).view(torch.float8_e4m3fn)
        place(kv.view(torch.float8_e4m3fn), cache8, layout, torch.arange(T), rope=rope, old_positions=old,
              new_positions=new, k_scale=k_scale, backend=backend)
        assert torch.equal(cache8.view(torch.uint8), cache)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(VLLM_LAYOUTS))
def test_per_layer_strided_views_of_one_buffer_equal_the_stacked_cache(backend, name):
    """vLLM gives every layer an as_strided view of one buffer; for layer-inner layouts (BLHNC ...)
    those views are not dense. place/gather on the list equal place/gather on the whole buffer."""
    L, B, H, N, D = 3, 4, 2, 4, 16
    layout = KVLayout.from_vllm(name, num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16)
    flat = layout.allocate(fill=POISON).view(-1)
    stacked = layout.allocate(fill=POISON)
    lstride = layout.k_strides[0]
    views = [flat.as_strided((B, H, N, 2 * D), (layout.k_strides[1], layout.k_strides[2], layout.k_strides[3], 1),
                             l * lstride) for l in range(L)]
    gen = torch.Generator().manual_seed(6)
    kv = torch.randn(2, L, 9, H, D, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(B * N, generator=gen)[:9]
    rope = RopeSpec(D, D, 10000.0, False, 64, torch.bfloat16)
    kw = dict(rope=rope, old_positions=torch.arange(9), new_positions=torch.arange(9) + 20)
    place(kv, views, layout, slots, backend=backend, **kw)
    place(kv, stacked, layout, slots, backend=backend, **kw)
    assert torch.equal(_bits(flat), _bits(stacked.view(-1)))
    assert torch.equal(_bits(gather(views, layout, slots, backend=backend)),
                       _bits(gather(stacked, layout, slots, backend=backend)))


# ================================================================================ bad input
def _setup(dtype=torch.bfloat16):
    layout = KVLayout.from_vllm("LBNHC", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=16,
                                dtype=dtype)
    rope = RopeSpec(16, 8, 10000.0, False, 64, torch.bfloat16 if dtype == torch.uint8 else dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 3, 2, 16, generator=gen)
    kv = x.to(torch.float8_e4m3fn).view(torch.uint8) if dtype == torch.uint8 else x.to(dtype)
    cache = layout.allocate(fill=POISON)
    return layout, rope, kv, cache


def _refused(call, tensors, match=None, error=LayoutError):
    """``call`` raises ``error`` (a KmeshError) matching ``match``; every tensor is unchanged bit for bit."""
    before = [_bits(t).clone() for t in tensors]
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, KmeshError)
    for t, b in zip(tensors, before):
        assert torch.equal(_bits(t), b), "a refused call wrote into the cache"
    return str(info.value)


_SL, _OLD, _NEW = [0, 5, 9], [1, 2, 3], [4, 5, 6]
I64_MAX, I64_MIN = (1 << 63) - 1, -(1 << 63)


def _bad(name, **change):
    return pytest.param(change, id=name)


BAD_PLACE = [
    # slots: values (range, the skip value, duplicates), then type, dtype, shape
    _bad("slot-num_slots", slots=torch.tensor([0, 5, 16]), match=r"slots: expected values in \[-1, 16\)"),
    _bad("slot-huge", slots=torch.tensor([0, 5, 1 << 62]), match="slots: expected values"),
    _bad("slot-int64-max", slots=torch.tensor([0, 5, I64_MAX]), match="slots: expected values"),
    _bad("slot-minus-2", slots=torch.tensor([0, -2, 9]), match="slots: expected values"),
    _bad("slot-int64-min", slots=torch.tensor([I64_MIN, 5, 9]), match="slots: expected values"),
    _bad("slot-duplicate", slots=torch.tensor([9, 5, 9]), match="same destination slot"),
    _bad("slot-int32", slots=torch.tensor(_SL, dtype=torch.int32), match=r"slots: expected int64\[3\]"),
    _bad("slot-uint8", slots=torch.tensor(_SL, dtype=torch.uint8), match=r"slots: expected int64\[3\]"),
    _bad("slot-float", slots=torch.tensor(_SL, dtype=torch.float64), match=r"slots: expected int64\[3\]"),
    _bad("slot-bool", slots=torch.tensor([True, False, True]), match=r"slots: expected int64\[3\]"),
    _bad("slot-2d", slots=torch.tensor([_SL]), match=r"slots: expected int64\[3\]"),
    _bad("slot-0d", slots=torch.tensor(5), match=r"slots: expected int64\[3\]"),
    _bad("slot-short", slots=torch.tensor(_SL[:2]), match=r"slots: expected int64\[3\]"),
    _bad("slot-long", slots=torch.tensor(_SL + [10]), match=r"slots: expected int64\[3\]"),
    _bad("slot-list", slots=list(_SL), match="slots: expected a torch int64"),
    _bad("slot-numpy", slots=np.array(_SL, dtype=np.int64), match="slots: expected a torch int64"),
    # positions
    _bad("new-at-P", new_positions=torch.tensor([4, 5, 64]), match=r"new_positions: positions must lie in \[0, 64\)"),
    _bad("old-negative", old_positions=torch.tensor([1, -1, 3]), match=r"old_positions: positions must lie"),
    _bad("new-int64-max", new_positions=torch.tensor([4, I64_MAX, 6]), match="new_positions"),
    _bad("old-int32", old_positions=torch.tensor(_OLD, dtype=torch.int32), match=r"old_positions: expected int64\[3\]"),
    _bad("new-short", new_positions=torch.tensor(_NEW[:2]), match=r"new_positions: expected int64\[3\]"),
    _bad("new-2d", new_positions=torch.tensor([_NEW]), match=r"new_positions: expected int64\[3\]"),
    _bad("old-missing", old_positions=None, match="both are required"),
    _bad("new-missing", new_positions=None, match="both are required"),
    _bad("positions-without-rope", rope=None, match="given without rope"),
    # the segment
    _bad("kv-layers", kv=lambda kv: kv[:, :1].contiguous(), match=r"kv: expected \(2, L=2"),
    _bad("kv-heads", kv=lambda kv: kv[:, :, :, :1].contiguous(), match=r"kv: expected \(2, L=2"),
    _bad("kv-head-size", kv=lambda kv: kv[..., :8].contiguous(), match=r"kv: expected \(2, L=2"),
    _bad("kv-not-kv-pair", kv=lambda kv: kv[:1].contiguous(), match=r"kv: expected \(2, L=2"),
    _bad("kv-4d", kv=lambda kv: kv[0], match=r"kv: expected \(2, L=2"),
    _bad("kv-tokens", kv=lambda kv: kv[:, :, :2].contiguous(), match=r"slots: expected int64\[2\]"),
    _bad("kv-dtype", kv=lambda kv: kv.float(), match="kv: expected dtype"),
    _bad("kv-non-contiguous", kv=lambda kv: kv.transpose(2, 3).contiguous().transpose(2, 3), match="kv: expected a contiguous"),
    _bad("kv-meta", kv=lambda kv: kv.to("meta"), match="kv: expected device cpu"),
    _bad("kv-list", kv=lambda kv: kv.tolist(), match="kv: expected a tensor"),
    # the cache
    _bad("cache-dtype", cache=lambda c: c.float(), match="cache: expected dtype"),
    _bad("cache-slice", cache=lambda c: c[:1], match="tensor spans"),
    _bad("cache-too-short", cache=lambda c: c.view(-1)[:100], match="tensor spans"),
    _bad("cache-expanded", cache=lambda c: c[:1].expand(c.shape), match="tensor spans"),
    _bad("cache-list-length", cache=lambda c: [c[0]], match="expected 2 per-layer tensors"),
    _bad("cache-list-dtype", cache=lambda c: [c[0], c[1].float()], match=r"cache\[1\]: expected dtype"),
    _bad("cache-list-device", cache=lambda c: [c[0], c[1].to("meta")], match=r"cache\[1\]: all per-layer"),
    _bad("cache-list-empty", cache=lambda c: [], match="cache: expected a tensor or a list"),
    _bad("cache-none", cache=lambda c: None, match="cache: expected a tensor or a list"),
    _bad("cache-numpy", cache=lambda c: c.float().numpy(), match="cache: expected a tensor or a list"),
    _bad("cache-meta", cache=lambda c: c.to("meta"), match="kv: expected device meta"),
    # layout, RoPE spec, backend
    _bad("layout-str", layout="LBNHC", match="layout: expected a KVLayout"),
    _bad("layout-dict", layout=lambda lay: lay.to_dict(), match="layout: expected a KVLayout"),
    _bad("layout-other-dims", layout=lambda lay: KVLayout.from_vllm("LBNHC", num_layers=2, num_blocks=4, block_size=4,
                                                                     num_kv_heads=2, head_size=8,
                                                                     dtype=torch.bfloat16), match="rope: head_size"),
    _bad("layout-other-dtype", layout=lambda lay: KVLayout.from_vllm("LBNHC", num_layers=2, num_blocks=4, block_size=4,
                                                                      num_kv_heads=2, head_size=16,
                                                                      dtype=torch.float16), match="rope: dtype"),
    _bad("rope-dict", rope=lambda r: r.to_dict(), match="rope: expected a RopeSpec"),
    _bad("rope-head", rope=lambda r: RopeSpec(32, 8, 10000.0, False, 64, torch.bfloat16), match="rope: head_size"),
    _bad("rope-dtype", rope=lambda r: RopeSpec(16, 8, 10000.0, False, 64, torch.float16), match="rope: dtype"),
    _bad("k_scale-not-fp8", k_scale=0.5, match="k_scale: only meaningful for fp8"),
    _bad("backend-name", backend="triton", match="backend", error=BackendError),
    _bad("backend-cupy-on-cpu", backend="cupy", match="cupy", error=BackendError),
]


def _apply(change, base):
    args = dict(base)
    for key, value in change.items():
        if key in ("match", "error"):
            continue
        args[key] = value(args[key]) if callable(value) and not isinstance(value, type) else value
    return args


@pytest.mark.parametrize("api", ["place", "place_many"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change", BAD_PLACE)
def test_bad_input_is_refused_by_name_and_writes_nothing(change, backend, api):
    layout, rope, kv, cache = _setup()
    base = dict(kv=kv, cache=cache, layout=layout, slots=torch.tensor(_SL), rope=rope,
                old_positions=torch.tensor(_OLD), new_positions=torch.tensor(_NEW), backend=backend, k_scale=None)
    args = _apply(change, base)
    tensors = [cache]
    if isinstance(args["cache"], torch.Tensor) and args["cache"].device.type == "cpu":
        tensors.append(args["cache"])
    elif isinstance(args["cache"], list):
        tensors += [t for t in args["cache"] if t.device.type == "cpu"]
    if api == "place":
        call = lambda: place(args["kv"], args["cache"], args["layout"], args["slots"], rope=args["rope"],  # noqa: E731
                             old_positions=args["old_positions"], new_positions=args["new_positions"],
                             k_scale=args["k_scale"], backend=args["backend"])
    else:
        # the batched form (its fast path on Warp): the same refusal, named for the item
        wrap = lambda x: None if x is None else [x]  # noqa: E731
        call = lambda: place_many([args["kv"]], args["cache"] if isinstance(args["cache"], torch.Tensor)  # noqa: E731
                                  else [args["cache"]], args["layout"], [args["slots"]], rope=args["rope"],
                                  old_positions=wrap(args["old_positions"]), new_positions=wrap(args["new_positions"]),
                                  k_scale=args["k_scale"], backend=args["backend"])
    # one item: place_many names its arguments as place does (kv, cache, slots: no index)
    _refused(call, tensors, change.get("match"), change.get("error", LayoutError))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k_scale", [0.0, -1.0, math.nan, math.inf, -math.inf, [1.0, 2.0, 3.0], [1.0, math.nan],
                                     [1.0, 0.0], torch.ones(3)])
def test_fp8_bad_k_scale_is_refused_and_writes_nothing(backend, k_scale):
    layout, rope, kv, cache = _setup(torch.uint8)
    _refused(lambda: place(kv, cache, layout, torch.tensor(_SL), rope=rope, old_positions=torch.tensor(_OLD),
                           new_positions=torch.tensor(_NEW), k_scale=k_scale, backend=backend), [cache], "k_scale")
    _refused(lambda: place_many([kv], cache, layout, [torch.tensor(_SL)], rope=rope, old_positions=[torch.tensor(_OLD)],
                                new_positions=[torch.tensor(_NEW)], k_scale=k_scale, backend=backend), [cache],
             "k_scale")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_cache_with_and_without_scale(backend):
    """fp8 caches: a shift without a scale uses 1.0 (same bits as k_scale=1.0); a per-layer scale
    list equals a tensor of the same values (powers of two: exact, so equal to no scale too);
    without RoPE K and V are copied bit for bit."""
    layout, rope, kv, _ = _setup(torch.uint8)
    kw = dict(rope=rope, old_positions=torch.tensor(_OLD), new_positions=torch.tensor(_NEW), backend=backend)
    outs = {}
    for name, ks in (("none", None), ("one", 1.0), ("list", [0.5, 2.0]), ("tensor", torch.tensor([0.5, 2.0]))):
        c = layout.allocate(fill=POISON)
        place(kv, c, layout, torch.tensor(_SL), k_scale=ks, **kw)
        outs[name] = c
    assert torch.equal(outs["none"], outs["one"]) and torch.equal(outs["list"], outs["tensor"])
    # the scale is applied on both sides of the rotation: a power of two changes no bit
    assert torch.equal(outs["one"], outs["list"])
    plain = layout.allocate(fill=POISON)
    place(kv, plain, layout, torch.tensor(_SL), backend=backend)
    assert torch.equal(gather(plain, layout, torch.tensor(_SL), backend=backend), kv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_value_only_minus_one(backend):
    """-1 skips a token (nothing of it is written, its positions are not checked); -2 is refused."""
    layout, rope, kv, cache = _setup()
    ref = cache.clone()
    place(kv, cache, layout, torch.tensor([-1, 5, -1]), rope=rope, old_positions=torch.tensor([-50, 2, 1 << 40]),
          new_positions=torch.tensor([1 << 50, 5, -3]), backend=backend)
    changed = (_bits(cache) != _bits(ref)).reshape(-1).nonzero().reshape(-1)
    # only slot 5's K and V rows changed: block 1, token 1 of each layer and head
    want = set()
    for l in range(2):
        for h in range(2):
            for which in ("k", "v"):
                offs = layout.element_offsets(which, l, 1, h, 1) * cache.element_size()
                want |= {int(o) + b for o in offs for b in range(cache.element_size())}
    assert set(changed.tolist()) <= want and len(changed) > 0
    everything_skipped = cache.clone()
    place(kv, cache, layout, torch.full((3,), -1), rope=rope, old_positions=torch.full((3,), -9),
          new_positions=torch.full((3,), 99), backend=backend)
    assert torch.equal(_bits(cache), _bits(everything_skipped))


# ---------------------------------------------------------------------------------- place_many
def _many_setup():
    layout, rope, kv, cache = _setup()
    kv2 = (kv.float() * 3).to(torch.bfloat16)
    return layout, rope, kv, kv2, cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_place_many_mismatched_lists_are_refused(backend):
    layout, rope, kv, kv2, cache = _many_setup()
    s1, s2 = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])
    o, n = torch.tensor(_OLD), torch.tensor(_NEW)
    calls = {
        "slots": lambda: place_many([kv, kv2], cache, layout, [s1], backend=backend),
        "caches": lambda: place_many([kv, kv2], [cache], layout, [s1, s2], backend=backend),
        "old": lambda: place_many([kv, kv2], cache, layout, [s1, s2], rope=rope, old_positions=[o],
                                  new_positions=[n, n], backend=backend),
        "new": lambda: place_many([kv, kv2], cache, layout, [s1, s2], rope=rope, old_positions=[o, o],
                                  new_positions=[n, n, n], backend=backend),
        "positions-missing": lambda: place_many([kv, kv2], cache, layout, [s1, s2], rope=rope, backend=backend),
        "kvs-empty-slots-not": lambda: place_many([], cache, layout, [s1], backend=backend),
    }
    for name, call in calls.items():
        msg = _refused(call, [cache])
        assert ("slots" in msg or "caches" in msg or "positions" in msg), (name, msg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_place_many_empty_and_zero_token_items(backend):
    layout, rope, kv, kv2, cache = _many_setup()
    before = cache.clone()
    place_many([], cache, layout, [], backend=backend)
    place_many([], [], layout, [], rope=rope, old_positions=[], new_positions=[], backend=backend)
    empty = kv[:, :, :0].contiguous()
    z = torch.zeros(0, dtype=torch.int64)
    place_many([empty, empty], cache, layout, [z, z], rope=rope, old_positions=[z, z], new_positions=[z, z],
               backend=backend)
    place(empty, cache, layout, z, rope=rope, old_positions=z, new_positions=z, backend=backend)
    assert torch.equal(_bits(cache), _bits(before))
    # zero-token items between real ones change nothing about the real ones
    s1, s2 = torch.tensor([0, 1, 2]), torch.tensor([9, 8, 7])
    o, n = torch.tensor(_OLD), torch.tensor(_NEW)
    a, b = layout.allocate(fill=POISON), layout.allocate(fill=POISON)
    place_many([empty, kv, empty, kv2, empty], a, layout, [z, s1, z, s2, z], rope=rope,
               old_positions=[z, o, z, o, z], new_positions=[z, n, z, n, z], backend=backend)
    place_many([kv, kv2], b, layout, [s1, s2], rope=rope, old_positions=[o, o], new_positions=[n, n], backend="torch")
    assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_place_many_items_overlapping_in_one_cache_are_refused(backend):
    """Promised: slots are distinct within each cache, across all items of the call (two writes to
    one slot would race). Also when the one cache is passed as different tensor objects over the
    same memory. Distinct caches may reuse slot numbers."""
    layout, rope, kv, kv2, cache = _many_setup()
    s1, s2 = torch.tensor([0, 1, 2]), torch.tensor([7, 2, 8])
    for caches in (cache, [cache, cache], [cache, cache.view(-1)], [cache.view(-1), cache.view(64, -1)]):
        msg = _refused(lambda: place_many([kv, kv2], caches, layout, [s1, s2], backend=backend), [cache])
        assert "same destination slot" in msg
    other = layout.allocate(fill=POISON)
    place_many([kv, kv2], [cache, other], layout, [s1, s2], backend=backend)
    assert torch.equal(gather(cache, layout, s1), kv) and torch.equal(gather(other, layout, s2), kv2)
    # the one cache as two tensor objects, its slots distinct: placed as into one tensor
    s3 = torch.tensor([7, 3, 8])
    one, two = layout.allocate(fill=POISON), layout.allocate(fill=POISON)
    place_many([kv, kv2], [one, one.view(-1)], layout, [s1, s3], backend=backend)
    place_many([kv, kv2], two, layout, [s1, s3], backend=backend)
    assert torch.equal(_bits(one), _bits(two))


@pytest.mark.parametrize("backend", BACKENDS)
def test_place_many_refusal_in_a_late_item_writes_no_earlier_item(backend):
    layout, rope, kv, kv2, cache = _many_setup()
    other = layout.allocate(fill=POISON)
    s1, o, n = torch.tensor([0, 1, 2]), torch.tensor(_OLD), torch.tensor(_NEW)
    bad = [
        ("slots[1]", dict(slots=[s1, torch.tensor([3, 4, 16])])),
        ("new_positions[1]", dict(new=[n, torch.tensor([1, 2, 64])])),
        ("kvs[1]", dict(kvs=[kv, kv2.float()])),
        ("caches[1]", dict(caches=[cache, other[:1]])),
    ]
    for name, ch in bad:
        msg = _refused(lambda: place_many(ch.get("kvs", [kv, kv2]), ch.get("caches", [cache, other]), layout,
                                          ch.get("slots", [s1, torch.tensor([3, 4, 5])]), rope=rope,
                                          old_positions=[o, o], new_positions=ch.get("new", [n, n]), backend=backend),
                       [cache, other])
        assert msg.startswith(name), (name, msg)


# ---------------------------------------------------------------------------------- gather
@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_validates_and_reads_duplicates(backend):
    layout, rope, kv, cache = _setup()
    place(kv, cache, layout, torch.tensor(_SL), backend=backend)
    before = cache.clone()
    for slots, match in ((torch.tensor([0, 16]), "slots: expected values"), (torch.tensor([-2]), "slots"),
                         (torch.tensor([0, 1], dtype=torch.int32), "slots: expected int64"),
                         ([0, 1], "slots: expected int64"), (torch.tensor([[0, 1]]), "slots: expected int64")):
        _refused(lambda: gather(cache, layout, slots, backend=backend), [cache], match)
    _refused(lambda: gather(cache[:1], layout, torch.tensor([0]), backend=backend), [cache], "tensor spans")
    _refused(lambda: gather(cache.float(), layout, torch.tensor([0]), backend=backend), [cache], "dtype")
    # reading a slot twice is allowed (only writes must be distinct)
    got = gather(cache, layout, torch.tensor([5, 5, -1, 0]), backend=backend)
    assert torch.equal(got[:, :, 0], kv[:, :, 1]) and torch.equal(got[:, :, 1], kv[:, :, 1])
    assert torch.equal(got[:, :, 3], kv[:, :, 0]) and not bool(_bits(got[:, :, 2]).any())
    assert torch.equal(_bits(cache), _bits(before))
    out = torch.empty(2, 2, 3, 2, 16, dtype=torch.bfloat16)
    assert gather(cache, layout, torch.tensor(_SL), out=out, backend=backend) is out and torch.equal(out, kv)


# ================================================================================ KVLayout
_KW = dict(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)


@pytest.mark.parametrize("field", ["num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"])
@pytest.mark.parametrize("value", [0, -1, -(1 << 40), True, None, [4]], ids=lambda v: repr(v))
def test_from_vllm_refuses_absurd_sizes(field, value):
    with pytest.raises(LayoutError, match="num_layers/num_blocks/block_size/num_kv_heads/head_size"):
        KVLayout.from_vllm("LBHNC", **dict(_KW, **{field: value}))


def test_from_vllm_refuses_bad_names_packings_dtypes_and_odd_heads():
    for name in ("lbhnc", "LBHN", "NHDC", "", None):
        with pytest.raises(LayoutError, match="name"):
            KVLayout.from_vllm(name, **_KW)
    for packing in ("Content", "kv", None):
        with pytest.raises(LayoutError, match="kv_packing"):
            KVLayout.from_vllm("LBHNC", kv_packing=packing, **_KW)
    for dtype in (torch.float64, torch.int32, torch.int8, torch.float8_e5m2, "float16"):
        with pytest.raises(LayoutError, match="dtype"):
            KVLayout.from_vllm("LBHNC", **dict(_KW, dtype=dtype))
    for d in (7, 81):
        with pytest.raises(LayoutError, match="head size D must be even"):
            KVLayout.from_vllm("LBHNC", **dict(_KW, head_size=d))


@pytest.mark.parametrize("packing", ["content", "planes"])
@pytest.mark.parametrize("name", _NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn], ids=str)
def test_layout_descriptions_round_trip(name, packing, dtype):
    lay = KVLayout.from_vllm(name, num_layers=3, num_blocks=5, block_size=7, num_kv_heads=2, head_size=80, dtype=dtype,
                             kv_packing=packing)
    back = KVLayout.from_dict(json.loads(json.dumps(lay.to_dict())))
    assert back == lay and back.extent == lay.extent and back.physical_shape == lay.physical_shape
    t = lay.allocate(fill=0x3C)
    assert tuple(t.shape) == lay.physical_shape and t.dtype == dtype and t.is_contiguous()
    assert t.numel() == lay.extent  # vLLM's layouts are dense
    assert bool((t.view(lay.storage_dtype) == 0x3C).all())  # fill is a value (fp8: a bit pattern)
    assert lay.num_slots == 35 and lay.storage_dtype == (torch.uint8 if dtype.itemsize == 1 else dtype)


@pytest.mark.parametrize("d", [
    None, [], "layout", {},
    {"sizes": [2, 3, 2, 4], "k_strides": [1] * 5, "v_strides": [1] * 5, "k_offset": 0, "v_offset": 0,
     "dtype": "float16", "physical_shape": [99]},
    {"sizes": [2, 3, 2, 4, 8], "k_strides": [192, 64, 32, 8, 1], "v_strides": [192, 64, 32, 8, 1], "k_offset": 0,
     "v_offset": 8, "dtype": "float64", "physical_shape": [2, 3, 2, 4, 16]},
    {"sizes": [2, 3, 2, 4, 8], "k_strides": [192, 64, 32, 8, 1], "v_strides": [192, 64, 32, 8, 1], "k_offset": 0,
     "v_offset": 8, "dtype": "nonexistent", "physical_shape": [2, 3, 2, 4, 16]},
    {"sizes": [2, 3, 2, 4, 8], "k_strides": [192, 64, 32, 8, 1], "v_strides": [192, 64, 32, 8, 1], "k_offset": 0,
     "v_offset": 8, "dtype": "float16", "physical_shape": [2, 3, 2, 4, 8]},  # too small
    {"sizes": [2, 3, 2, 4, 8], "k_strides": [192, 64, 32, 8, 1], "v_strides": [192, 64, 32, 8, 1], "k_offset": 0,
     "v_offset": 0, "dtype": "float16", "physical_shape": [2, 3, 2, 4, 16]},  # K is V
    {"sizes": [2, 3, 2, 4, 8], "k_strides": [192, 64, 32, 8, 1], "v_strides": [192, 64, 32, 8, 1], "k_offset": -8,
     "v_offset": 8, "dtype": "float16", "physical_shape": [2, 3, 2, 4, 16]},
    {"sizes": [2, 3, 2, 4, 8], "k_strides": [192, 64, 32, 8, 0], "v_strides": [192, 64, 32, 8, 1], "k_offset": 0,
     "v_offset": 8, "dtype": "float16", "physical_shape": [2, 3, 2, 4, 16]},  # stride 0 along D
], ids=lambda d: str(d)[:40])
def test_from_dict_refuses_malformed_descriptions(d):
    with pytest.raises(LayoutError):
        KVLayout.from_dict(d)


def test_large_layouts_of_every_kind_are_accepted():
    """Above 2**24 addressed elements the disjointness check is structural; the real layouts pass it."""
    kw = dict(num_layers=32, num_blocks=4096, block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    for name in _NAMES:
        for packing in ("content", "planes"):
            lay = KVLayout.from_vllm(name, kv_packing=packing, **kw)
            assert lay.extent == math.prod(lay.physical_shape) == 2 * 32 * 4096 * 16 * 8 * 128
    for axis in ("first", "second"):
        for order in ("NHD", "HND"):
            assert KVLayout.from_vllm_legacy(axis, order, **kw).extent == 2 * 32 * 4096 * 16 * 8 * 128
    # and within K (or V) an overlap is still found structurally
    st = (1 << 26, 1 << 13, 1 << 10, 64, 1)
    with pytest.raises(LayoutError, match="overlap"):
        KVLayout.from_strides((2, 4096, 8, 32, 128), st, st, 0, 1 << 27, dtype=torch.bfloat16)


# ================================================================================ RopeSpec
_ROPE = dict(head_size=64, rotary_dim=64, base=10000.0, is_neox_style=True, max_position=128, dtype=torch.float16)
SCALINGS = {
    "default": None,
    "default-explicit": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "linear-legacy-key": {"type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
             "beta_slow": 1, "truncate": False},
}


@pytest.mark.parametrize("change,match", [
    (dict(rotary_dim=63), "rotary_dim"), (dict(rotary_dim=66), "rotary_dim"), (dict(rotary_dim=0), "rotary_dim"),
    (dict(rotary_dim=-2), "rotary_dim"), (dict(rotary_dim=32.0), "rotary_dim"), (dict(rotary_dim=True), "rotary_dim"),
    (dict(head_size=63, rotary_dim=62), "rotary_dim"), (dict(head_size=0), "head_size"),
    (dict(base=0.0), "base"), (dict(base=-10000.0), "base"), (dict(base=1.0), "base"), (dict(base=math.nan), "base"),
    (dict(base="10000"), "base"), (dict(base=None), "base"),
    (dict(max_position=0), "max_position"), (dict(max_position=-1), "max_position"),
    (dict(max_position=True), "max_position"),
    (dict(dtype=torch.float64), "dtype"), (dict(dtype=torch.uint8), "dtype"),
    (dict(scaling="linear"), "scaling"), (dict(scaling={"rope_type": "longrope", "factor": 2.0}), "rope_type"),
    (dict(scaling={"rope_type": "su"}), "rope_type"),
    (dict(scaling={"rope_type": "linear"}), "factor"), (dict(scaling={"rope_type": "dynamic"}), "factor"),
    (dict(scaling={"rope_type": "linear", "factor": 0}), "factor"),
    (dict(scaling={"rope_type": "linear", "factor": -2.0}), "factor"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
     "original_max_position_embeddings"),
    (dict(scaling={"rope_type": "yarn", "factor": 4.0}), "original_max_position_embeddings"),
    (dict(scaling={"rope_type": "yarn", "original_max_position_embeddings": 64}), "factor"),
])
def test_rope_spec_refuses_invalid_values(change, match):
    with pytest.raises(LayoutError, match=match):
        RopeSpec(**dict(_ROPE, **change))


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rope_spec_round_trips_and_builds_its_table(kind, dtype):
    spec = RopeSpec(**dict(_ROPE, rotary_dim=48, dtype=dtype, scaling=SCALINGS[kind]))
    back = RopeSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert back == spec and hash(back) == hash(spec)
    table = spec.cos_sin_cache()
    assert table.shape == (spec.num_positions, 48) and table.dtype == dtype
    assert bool(torch.isfinite(table.float()).all())
    assert torch.equal(spec.cos_sin_fp32(), table.float())
    assert bool((table.float()[0, :24] == (1.0 if kind != "yarn" else table.float()[0, 0])).all())
    assert not bool(table.float()[0, 24:].any())  # sin(0) = 0
    expect_rows = {"linear": math.ceil(128 * 2.5), "linear-legacy-key": 256, "yarn": 128}.get(kind, 128)
    assert spec.num_positions == expect_rows


@pytest.mark.parametrize("d", [
    None, {}, {"head_size": 64},
    dict(RopeSpec(**_ROPE).to_dict(), dtype="float64"), dict(RopeSpec(**_ROPE).to_dict(), dtype="nonexistent"),
    dict(RopeSpec(**_ROPE).to_dict(), base="nan"), dict(RopeSpec(**_ROPE).to_dict(), rotary_dim=None),
    dict(RopeSpec(**_ROPE).to_dict(), scaling={"rope_type": "yarn"}),
], ids=lambda d: str(d)[:40])
def test_rope_from_dict_refuses_malformed(d):
    with pytest.raises(LayoutError):
        RopeSpec.from_dict(d)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["linear", "yarn", "default"])
def test_positions_bounded_by_the_table_rows(backend, kind):
    """The last row is usable; one past it is refused by place, place_many and rope_shift alike."""
    scaling = {"linear": {"rope_type": "linear", "factor": 1.5},
               "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 24},
               "default": None}[kind]
    rope = RopeSpec(16, 16, 10000.0, True, 32, torch.bfloat16, scaling)
    P = rope.num_positions
    assert P == {"linear": 48, "yarn": 48, "default": 32}[kind] == rope.cos_sin_cache().shape[0]
    layout, _, kv, cache = _setup()
    layout = KVLayout.from_vllm("LBNHC", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=16,
                                dtype=torch.bfloat16)
    sl = torch.tensor(_SL)
    ok_old, ok_new = torch.tensor([0, P - 1, 3]), torch.tensor([P - 1, 0, 5])
    place(kv, cache, layout, sl, rope=rope, old_positions=ok_old, new_positions=ok_new, backend=backend)
    assert torch.equal(gather(cache, layout, sl)[0], rope_shift(kv[0], ok_old, ok_new, rope))
    for old, new, name in ((torch.tensor([0, P, 3]), ok_new, "old_positions"),
                           (ok_old, torch.tensor([P, 0, 5]), "new_positions")):
        _refused(lambda: place(kv, cache, layout, sl, rope=rope, old_positions=old, new_positions=new,
                               backend=backend), [cache], rf"{name}: positions must lie in \[0, {P}\)")
        _refused(lambda: place_many([kv], cache, layout, [sl], rope=rope, old_positions=[old], new_positions=[new],
                                    backend=backend), [cache], rf"{name}: positions must lie in \[0, {P}\)")
        with pytest.raises(LayoutError, match=name):
            rope_shift(kv[0], old, new, rope)


def test_rope_shift_validates_its_arguments():
    rope = RopeSpec(16, 8, 10000.0, False, 32, torch.float32)
    k = torch.randn(2, 4, 3, 16)
    p = torch.tensor([0, 1, 2, 3])
    for args, match in (((k.double(), p, p, rope), "k: expected fp32"), ((k[..., :8], p, p, rope), "k: expected"),
                        ((k[0, 0], p, p, rope), "k: expected"), ((k, p[:3], p, rope), r"old_positions: expected int64\[T=4\]"),
                        ((k, p, p.int(), rope), "new_positions: expected int64"), ((k, p, p, None), "rope: expected"),
                        ((k, p, p.float(), rope), "new_positions: expected int64"),
                        ((k, p - 1, p, rope), "old_positions: positions must lie")):
        with pytest.raises(LayoutError, match=match):
            rope_shift(*args)
    out = rope_shift(k, p, p + 7, rope)
    assert out.shape == k.shape and out.dtype == k.dtype
    assert torch.equal(out[..., 8:], k[..., 8:])  # dims past rotary_dim are not touched
    assert torch.allclose(rope_shift(out, p + 7, p, rope), k, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "warp"])
def test_source_inside_any_layer_of_a_per_layer_cache_is_refused(backend):
    """The aliasing check covers every layer's bytes of a per-layer cache (the fast path's and the
    general path's): a segment inside layer 1 (not only layer 0) is refused and nothing is written."""
    lay = KVLayout.from_vllm("LBHNC", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                             dtype=torch.float32)
    layers = [torch.randn(lay.physical_shape[1:], generator=torch.Generator().manual_seed(i)) for i in range(2)]
    before = [x.clone() for x in layers]
    T = 6
    kv = layers[1].view(-1)[:2 * 2 * T * 2 * 8].view(2, 2, T, 2, 8)
    with pytest.raises(LayoutError, match="kv"):
        place(kv, layers, lay, torch.arange(T) + 1, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(layers, before))
