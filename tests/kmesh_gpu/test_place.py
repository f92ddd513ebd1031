"""place / place_many / gather: every layout x dtype x RoPE style, bit for bit against an independent
reference, poisoned caches (every byte outside the addressed slots must keep its poison), and
cupy == warp == torch on CUDA."""

from __future__ import annotations

import pytest
import torch

from kmesh_gpu import KVLayout, LayoutError, RopeSpec, gather, place, place_many
from tests.helpers.devices import DEVICES, backends_for
from tests.helpers.kvref import ALL_CASES, Case, build, reference_place

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}
ROPES = {
    "none": None,
    "neox": dict(rotary_dim=16, is_neox_style=True),
    "gptj-partial": dict(rotary_dim=8, is_neox_style=False),
    "neox-partial": dict(rotary_dim=10, is_neox_style=True),
}
POISON = 0xA5  # fp8 0xA5 and the bf16/fp16/fp32 patterns it makes are all finite numbers
DIMS = dict(L=3, B=6, H=2, N=4, D=16)
MAXPOS = 512


def _segment(dtype, T, gen, L=DIMS["L"], H=DIMS["H"], D=DIMS["D"], device="cpu"):
    x = torch.randn(2, L, T, H, D, generator=gen) * 2
    if dtype == torch.uint8:
        return x.to(torch.float8_e4m3fn).view(torch.uint8).to(device)
    return x.to(dtype).to(device)


def _rope(style, dtype):
    spec = ROPES[style]
    if spec is None:
        return None
    model_dtype = torch.bfloat16 if dtype == torch.uint8 else dtype
    return RopeSpec(DIMS["D"], spec["rotary_dim"], 10000.0, spec["is_neox_style"], MAXPOS, model_dtype)


def _inputs(T, gen, nslots, device="cpu"):
    slots = torch.randperm(nslots, generator=gen)[:T].to(torch.int64)
    slots[T // 3] = -1  # a padding token
    old = torch.randint(0, MAXPOS, (T,), generator=gen)
    new = torch.randint(0, MAXPOS, (T,), generator=gen)
    return slots.to(device), old.to(device), new.to(device)


def _bits(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _run_case(case, dtype, style, backend, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layout, views = build(case, dtype=dtype, **DIMS)
    rope = _rope(style, dtype)
    T = 11
    kv = _segment(dtype, T, gen)
    slots, old, new = _inputs(T, gen, layout.num_slots)
    k_scale = 0.75 if dtype == torch.uint8 and rope is not None else None
    cache = layout.allocate(fill=POISON)
    expected = reference_place(cache, views, kv, slots, N=DIMS["N"], rope=rope, old=old, new=new,
                               k_scale=k_scale or 1.0)
    dev_cache = cache.to(device)
    kw = dict(rope=rope, old_positions=old.to(device), new_positions=new.to(device)) if rope is not None else {}
    place(kv.to(device), dev_cache, layout, slots.to(device), k_scale=k_scale, backend=backend, **kw)
    return _bits(expected), _bits(dev_cache.cpu())


# The CPU grid: every arrangement with bf16 + neox, every dtype x RoPE style on three arrangements.
GRID = ([(c, "bf16", "neox") for c in ALL_CASES]
        + [(c, d, r) for c in (Case("named", "LBNHC"), Case("planes", "LBHNC"), Case("legacy", "second/HND"))
           for d in DTYPES for r in ROPES])


@pytest.mark.parametrize("backend", ["torch", "warp"])
@pytest.mark.parametrize("case,dtype,style", GRID, ids=[f"{c.id}-{d}-{r}" for c, d, r in GRID])
def test_place_matches_reference_cpu(case, dtype, style, backend):
    expected, got = _run_case(case, DTYPES[dtype], style, backend, "cpu")
    assert torch.equal(expected, got), f"{(expected != got).sum()} bytes differ"


# The seed's 32 synthetic GPU cases: 8 arrangements x 4 dtypes, neox shift, for every CUDA backend.
GPU_CASES = [(c, d) for c in (ALL_CASES[:6] + [Case("planes", "LBHNC"), Case("padded", "custom")]) for d in DTYPES]


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", GPU_CASES, ids=[f"{c.id}-{d}" for c, d in GPU_CASES])
def test_place_gpu_seed_cases(case, dtype):
    results = {}
    for backend in backends_for("cuda"):
        expected, got = _run_case(case, DTYPES[dtype], "neox", backend, "cuda")
        # the reference runs on the CPU; CUDA's cos/sin table may differ, so compare GPU backends
        # with each other bit for bit, and with the CPU reference within the model dtype's rounding
        results[backend] = got
    first = next(iter(results.values()))
    for backend, got in results.items():
        assert torch.equal(first, got), f"{backend} differs from {next(iter(results))}"
    cpu_expected, _ = _run_case(case, DTYPES[dtype], "neox", "torch", "cpu")
    _assert_close_to_reference(case, DTYPES[dtype], cpu_expected, first)


def _assert_close_to_reference(case, dtype, expected_bits, got_bits):
    """Untouched bytes identical; placed values within 1 unit of rounding of the CPU reference."""
    layout, views = build(case, dtype=dtype, **DIMS)
    as_dtype = (lambda b: b.view(dtype).view(layout.physical_shape)) if dtype != torch.uint8 else \
        (lambda b: b.view(layout.physical_shape))
    e, g = as_dtype(expected_bits), as_dtype(got_bits)
    ek, ev = views(e)
    gk, gv = views(g)
    assert torch.equal(_bits(ev.contiguous()), _bits(gv.contiguous()))  # V and all of V's untouched bytes
    if dtype == torch.uint8:
        diff = (ek.contiguous().view(torch.float8_e4m3fn).float() - gk.contiguous().view(torch.float8_e4m3fn).float())
        assert float(diff.abs().max()) <= 0.5
    else:
        assert torch.allclose(ek.float(), gk.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_backends_agree_bit_for_bit(device):
    """cupy == warp == torch on the same device, all dtypes, neox and partial GPT-J shifts."""
    for dtype in DTYPES.values():
        for style in ("neox", "gptj-partial"):
            outs = {}
            for backend in backends_for(device):
                _, outs[backend] = _run_case(Case("named", "BHLNC"), dtype, style, backend, device, seed=3)
            ref = outs["torch"]
            for backend, got in outs.items():
                assert torch.equal(ref, got), f"{backend} != torch for {dtype} {style} on {device}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared_cache", [False, True], ids=["private-caches", "one-cache"])
def test_place_many_equals_sequential_place(device, shared_cache):
    """4 segments x 4 children in one launch equals 16 separate placements."""
    gen = torch.Generator().manual_seed(7)
    layout = KVLayout.from_vllm("LBHNC", num_layers=2, num_blocks=40, block_size=4, num_kv_heads=2, head_size=16,
                                dtype=torch.bfloat16)
    rope = RopeSpec(16, 16, 1e6, True, MAXPOS, torch.bfloat16)
    n_children, n_segments = 4, 4
    seg = [_segment(torch.bfloat16, 5 + s, gen, L=2, device=device) for s in range(n_segments)]
    perm = torch.randperm(layout.num_slots, generator=gen)
    kvs, slots, olds, news, caches_a, caches_b = [], [], [], [], [], []
    if shared_cache:
        ca, cb = layout.allocate(device, fill=POISON), layout.allocate(device, fill=POISON)
    used = 0
    for c in range(n_children):
        if not shared_cache:
            ca, cb = layout.allocate(device, fill=POISON), layout.allocate(device, fill=POISON)
            used = 0
        for s in range(n_segments):
            T = seg[s].shape[2]
            kvs.append(seg[s])
            slots.append(perm[used:used + T].to(device))
            used += T
            olds.append(torch.arange(T, device=device) + 10 * s)
            news.append(torch.randint(0, MAXPOS, (T,), generator=gen).to(device))
            caches_a.append(ca)
            caches_b.append(cb)
    for backend in backends_for(device):
        for c in {id(x): x for x in caches_a + caches_b}.values():
            c.fill_(POISON)
        place_many(kvs, caches_a, layout, slots, rope=rope, old_positions=olds, new_positions=news, backend=backend)
        for i in range(len(kvs)):
            place(kvs[i], caches_b[i], layout, slots[i], rope=rope, old_positions=olds[i], new_positions=news[i],
                  backend="torch")
        for a, b in zip(caches_a, caches_b):
            assert torch.equal(_bits(a), _bits(b)), backend


@pytest.mark.parametrize("device", DEVICES)
def test_per_layer_tensor_list_equals_stacked(device):
    gen = torch.Generator().manual_seed(11)
    layout = KVLayout.from_vllm_legacy("first", "NHD", num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2,
                                       head_size=16, dtype=torch.float16)
    rope = RopeSpec(16, 16, 10000.0, True, MAXPOS, torch.float16)
    kv = _segment(torch.float16, 9, gen, device=device)
    slots, old, new = (t.to(device) for t in _inputs(9, gen, layout.num_slots))
    for backend in backends_for(device):
        stacked = layout.allocate(device, fill=POISON)
        layers = [torch.full(layout.physical_shape[1:], POISON, dtype=torch.float16, device=device)
                  for _ in range(3)]
        place(kv, stacked, layout, slots, rope=rope, old_positions=old, new_positions=new, backend=backend)
        place(kv, layers, layout, slots, rope=rope, old_positions=old, new_positions=new, backend=backend)
        assert torch.equal(_bits(stacked), _bits(torch.stack(layers))), backend
        back = gather(layers, layout, slots, backend=backend)
        assert torch.equal(_bits(back), _bits(gather(stacked, layout, slots, backend=backend)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [Case("named", "BLHNC"), Case("planes", "BLNHC"), Case("padded", "custom")],
                         ids=lambda c: c.id)
def test_gather_round_trip(device, case):
    gen = torch.Generator().manual_seed(5)
    for dtype in DTYPES.values():
        layout, _ = build(case, dtype=dtype, **DIMS)
        kv = _segment(dtype, 13, gen, device=device)
        slots, _, _ = (t.to(device) for t in _inputs(13, gen, layout.num_slots))
        for backend in backends_for(device):
            cache = layout.allocate(device, fill=POISON)
            place(kv, cache, layout, slots, backend=backend)
            back = gather(cache, layout, slots, backend=backend)
            valid = slots >= 0
            assert torch.equal(_bits(back)[:, :, valid], _bits(kv)[:, :, valid])
            assert not bool(_bits(back)[:, :, ~valid].any())  # skipped tokens come back as zeros


def test_shift_moves_keys_to_the_new_rotation():
    """A key rotated at p and shifted to q is (within bf16 rounding) the key rotated at q."""
    gen = torch.Generator().manual_seed(2)
    rope = RopeSpec(16, 16, 10000.0, True, MAXPOS, torch.float32)
    layout = KVLayout.from_vllm("LBHNC", num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_size=16,
                                dtype=torch.float32)
    raw = torch.randn(1, 1, 8, 1, 16, generator=gen)
    p = torch.randint(0, MAXPOS, (8,), generator=gen)
    q = torch.randint(0, MAXPOS, (8,), generator=gen)
    table = rope.cos_sin_cache()

    def rotate(x, pos):
        c, s = table[pos, :8].view(1, -1, 1, 8), table[pos, 8:].view(1, -1, 1, 8)
        x1, x2 = x[..., :8], x[..., 8:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    kv = torch.cat((rotate(raw[0], p).unsqueeze(0), raw), 0)
    cache = layout.allocate(fill=0)
    slots = torch.arange(8)
    place(kv, cache, layout, slots, rope=rope, old_positions=p, new_positions=q, backend="warp")
    got = gather(cache, layout, slots)[0]
    assert torch.allclose(got, rotate(raw[0], q), atol=1e-5)
    assert torch.equal(gather(cache, layout, slots)[1], raw[0])  # V untouched by the shift


# ------------------------------------------------------------------------------------------ bad input
def _bad_setup():
    layout = KVLayout.from_vllm("LBHNC", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=16,
                                dtype=torch.bfloat16)
    rope = RopeSpec(16, 16, 10000.0, True, 64, torch.bfloat16)
    kv = torch.randn(2, 2, 3, 2, 16).to(torch.bfloat16)
    cache = layout.allocate(fill=POISON)
    return layout, rope, kv, cache


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(slots=torch.tensor([0, 1, 2], dtype=torch.int32)), "slots: expected int64"),
    (lambda a: a.update(slots=torch.tensor([0, 1, 16])), r"slots: expected values in \[-1, 16\)"),
    (lambda a: a.update(slots=torch.tensor([0, -2, 3])), "slots: expected values"),
    (lambda a: a.update(slots=torch.tensor([5, 1, 5])), "same destination slot"),
    (lambda a: a.update(slots=torch.tensor([0, 1])), r"slots: expected int64\[3\]"),
    (lambda a: a.update(kv=a["kv"].float()), "kv: expected dtype"),
    (lambda a: a.update(kv=a["kv"][:, :1]), "kv: expected"),
    (lambda a: a.update(kv=a["kv"].transpose(3, 2)), "kv: expected"),
    (lambda a: a.update(new_positions=torch.tensor([0, 1, 64])), r"new_positions: positions must lie in \[0, 64\)"),
    (lambda a: a.update(old_positions=torch.tensor([-1, 1, 2])), "old_positions"),
    (lambda a: a.update(old_positions=None), "required"),
    (lambda a: a.update(rope=None), "given without rope"),
    (lambda a: a.update(cache=a["cache"][:, :2]), "tensor spans"),
    (lambda a: a.update(cache=a["cache"].float()), "cache: expected dtype"),
    (lambda a: a.update(layout="LBHNC"), "layout: expected a KVLayout"),
    (lambda a: a.update(backend="triton"), "backend"),
    (lambda a: a.update(rope=RopeSpec(16, 16, 10000.0, True, 64, torch.float16)), "rope: dtype"),
])
def test_bad_input_raises_and_writes_nothing(mutate, match):
    layout, rope, kv, cache = _bad_setup()
    before = cache.clone()
    args = dict(kv=kv, cache=cache, layout=layout, slots=torch.tensor([0, 1, 2]), rope=rope,
                old_positions=torch.tensor([1, 2, 3]), new_positions=torch.tensor([4, 5, 6]), backend="torch")
    mutate(args)
    from kmesh_gpu import KmeshError

    with pytest.raises(KmeshError, match=match):
        place(args.pop("kv"), args.pop("cache"), args.pop("layout"), args.pop("slots"), **args)
    assert torch.equal(_bits(cache), _bits(before))


def test_slot_range_error_names_the_argument_and_bounds():
    layout, rope, kv, cache = _bad_setup()
    with pytest.raises(LayoutError) as err:
        place(kv, cache, layout, torch.tensor([0, 1, 99]), backend="warp")
    assert "num_blocks x block_size = 4 x 4" in str(err.value)


def test_private_slots_checked_skips_only_the_slot_checks():
    """``_slots_checked`` (the cache service's prepared path): same bits as the checked path; slot
    range and duplicates are the caller's promise, everything else is still validated."""
    from kmesh_gpu.place import prepare_place_many

    layout, rope, kv, cache = _bad_setup()
    slots, old, new = torch.tensor([0, 5, 2]), torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    ref = cache.clone()
    place_many([kv], ref, layout, [slots], rope=rope, old_positions=[old], new_positions=[new], backend="torch")
    got = cache.clone()
    prepare_place_many([kv], got, layout, [slots], rope=rope, old_positions=[old], new_positions=[new],
                       backend="torch", _slots_checked=True).run()
    assert torch.equal(_bits(got), _bits(ref))
    # a duplicate is not looked for any more (the caller proved there is none) ...
    prepare_place_many([kv], got, layout, [torch.tensor([0, 0, 1])], rope=rope, old_positions=[old],
                       new_positions=[new], backend="torch", _slots_checked=True)
    with pytest.raises(LayoutError, match="more than once"):
        prepare_place_many([kv], got, layout, [torch.tensor([0, 0, 1])], rope=rope, old_positions=[old],
                           new_positions=[new], backend="torch")
    # ... but positions, shapes and the one-cache promise still are
    with pytest.raises(LayoutError):
        prepare_place_many([kv], got, layout, [slots], rope=rope, old_positions=[old],
                           new_positions=[torch.tensor([4, 5, 99999])], backend="torch", _slots_checked=True)
    with pytest.raises(LayoutError, match="int64"):
        prepare_place_many([kv], got, layout, [slots[:2]], rope=rope, old_positions=[old], new_positions=[new],
                           backend="torch", _slots_checked=True)
    with pytest.raises(LayoutError, match="one destination cache"):
        prepare_place_many([kv, kv], [got, got.clone()], layout, [slots, slots], rope=rope,
                           old_positions=[old, old], new_positions=[new, new], backend="torch", _slots_checked=True)


# The run kernel (kmesh_place_runs, the CUDA fast path for 16-byte-aligned layouts) against the
# per-token kernels and the torch reference: head 64, full and partial rotary dims, both pairings,
# every dtype, slots in runs that start mid-block and cross block boundaries, padding tokens.
RUN_ROPES = [(64, True), (32, True), (64, False), (32, False), (None, None)]


def _run_kernel_case(dtype, rd, neox, gather_too, device="cuda"):
    import importlib

    place_mod = importlib.import_module("kmesh_gpu.place")
    L, H, D, N, B, T = 3, 2, 64, 16, 12, 45
    gen = torch.Generator().manual_seed(7)
    layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=dtype)
    kv = _segment(dtype, T, gen, L=L, H=H, D=D)
    # slot 5 .. 5+20 (mid-block start, crosses a block), then a shuffled tail and a padding token
    slots = torch.cat([torch.arange(5, 25), torch.arange(7 * N + 3, 7 * N + 3 + 24), torch.tensor([-1])])
    slots = slots[:T].to(torch.int64)
    slots[30] = -1
    old = torch.randint(0, MAXPOS, (T,), generator=gen)
    new = torch.randint(0, MAXPOS, (T,), generator=gen)
    model_dtype = torch.bfloat16 if dtype == torch.uint8 else dtype
    rope = RopeSpec(D, rd, 10000.0, neox, MAXPOS, model_dtype) if rd else None
    k_scale = 0.75 if dtype == torch.uint8 and rope is not None else None
    kw = dict(rope=rope, old_positions=old.to(device), new_positions=new.to(device)) if rope else {}
    outs = {}
    for name, backend, runs in (("torch", "torch", False), ("cupy-tokens", "cupy", False), ("cupy-runs", "cupy", True)):
        saved = place_mod._RUNS
        place_mod._RUNS = runs
        try:
            cache = layout.allocate(device, fill=0)
            _bits(cache).fill_(POISON)
            place(kv.to(device), cache, layout, slots.to(device), k_scale=k_scale, backend=backend, **kw)
            back = None
            if gather_too:
                back = torch.full_like(kv, 0x5A if dtype == torch.uint8 else 7).to(device)
                gather(cache, layout, slots.to(device), out=back, backend=backend)
            outs[name] = (_bits(cache).cpu(), None if back is None else _bits(back).cpu())
        finally:
            place_mod._RUNS = saved
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("rd,neox", RUN_ROPES, ids=[f"rd{r}-{'neox' if n else 'gptj'}" if r else "none"
                                                    for r, n in RUN_ROPES])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_run_kernel_matches_token_kernels(dtype, rd, neox):
    outs = _run_kernel_case(DTYPES[dtype], rd, neox, gather_too=rd is None)
    ref_cache, ref_back = outs["torch"]
    for name in ("cupy-tokens", "cupy-runs"):
        cache, back = outs[name]
        assert torch.equal(ref_cache, cache), f"{name}: {(ref_cache != cache).sum()} bytes differ from torch"
        if ref_back is not None:
            assert torch.equal(ref_back, back), f"{name}: gather differs from torch"


def test_run_rows_split():
    """Runs: consecutive tokens of one item in consecutive slots of one block, at most `cap` long."""
    import numpy as np

    from kmesh_gpu._place_tables import _run_rows

    slots = np.array([32, 33, 34, 35, -1, 36, 37, 47, 48, 49, 5, 6, 7] + list(range(64, 104)), dtype=np.int64)
    item = np.array([0] * 12 + [1] * 41)
    first, length = _run_rows(slots, item, 16, 16)
    assert list(zip(first.tolist(), length.tolist())) == [(0, 4), (5, 2), (7, 1), (8, 2), (10, 2), (12, 1),
                                                          (13, 16), (29, 16), (45, 8)]
    first, length = _run_rows(slots, item, 16, 3)
    assert length.max() == 3 and length.sum() == (slots >= 0).sum()
    first, length = _run_rows(np.array([-1, -1], dtype=np.int64), np.zeros(2, dtype=np.int64), 16, 8)
    assert first.size == 0 and length.size == 0


# prepare_place_many's fast path (one cache tensor, host int64 indices) against the general path:
# the same bits, the same run tables, and the same typed errors with nothing written.
def _fast_vs_general(fn):
    import importlib

    place_mod = importlib.import_module("kmesh_gpu.place")
    out = {}
    for fast in (True, False):
        saved = place_mod._FAST
        place_mod._FAST = fast
        try:
            out[fast] = fn()
        finally:
            place_mod._FAST = saved
    return out[True], out[False]


def _fast_batch(gen, layout, T=(5, 7, 4), skip=True):
    kvs = [_segment(torch.bfloat16, t, gen) for t in T]
    perm = torch.randperm(layout.num_slots, generator=gen)
    slots, olds, news, at = [], [], [], 0
    for t in T:
        slots.append(perm[at:at + t].clone())
        at += t
        olds.append(torch.randint(0, MAXPOS, (t,), generator=gen))
        news.append(torch.randint(0, MAXPOS, (t,), generator=gen))
    if skip:
        slots[1][2] = -1
    return kvs, slots, olds, news


@pytest.mark.parametrize("backend", ["warp", "torch"])
def test_fast_path_matches_general_path(backend):
    gen = torch.Generator().manual_seed(3)
    layout = KVLayout.from_vllm("NHD", num_layers=DIMS["L"], num_blocks=DIMS["B"], block_size=DIMS["N"],
                                num_kv_heads=DIMS["H"], head_size=DIMS["D"], dtype=torch.bfloat16)
    rope = _rope("neox", torch.bfloat16)
    kvs, slots, olds, news = _fast_batch(gen, layout)
    olds[1][2] = MAXPOS + 5  # out of range, but its token is skipped: never read, accepted

    def run():
        cache = layout.allocate(fill=POISON)
        place_many(kvs, cache, layout, slots, rope=rope, old_positions=olds, new_positions=news, backend=backend)
        return _bits(cache)

    fast, general = _fast_vs_general(run)
    assert torch.equal(fast, general)


def test_fast_run_table_matches_general(monkeypatch):
    """The run kernel's tables (built on the CPU as for CUDA) from both paths: same runs, positions,
    layer bases; consecutive slots across items and blocks, a mid-block start, a skipped token."""
    import importlib

    import numpy as np

    place_mod = importlib.import_module("kmesh_gpu.place")
    from kmesh_gpu import _backend

    monkeypatch.setattr(_backend, "choose", lambda backend, device: "cupy")
    L, H, D, N = 3, 2, 64, 16
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=12, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16)
    rope = RopeSpec(D, D, 10000.0, True, MAXPOS, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    T = (20, 33, 9)
    kvs = [_segment(torch.bfloat16, t, gen, L=L, H=H, D=D) for t in T]
    starts = (5, 25, 7 * N + 3)
    slots = [torch.arange(s, s + t, dtype=torch.int64) for s, t in zip(starts, T)]
    slots[1][4] = -1
    olds = [torch.randint(0, MAXPOS, (t,), generator=gen) for t in T]
    news = [torch.randint(0, MAXPOS, (t,), generator=gen) for t in T]
    cache = layout.allocate(fill=0)

    def prep():
        return place_mod.prepare_place_many(kvs, cache, layout, slots, rope=rope, old_positions=olds,
                                            new_positions=news)

    fast, general = _fast_vs_general(prep)
    assert fast.tables["runs"] is not None and general.tables["runs"] is not None

    def host(launch):
        runs_ptr, pos_ptr, base_ptr, R = launch.tables["run_args"]
        Ttot = launch.tables["total"]
        buf = launch.tables.get("buffer")
        if buf is not None:  # fast path: [layer bases | old, new | runs] in one buffer
            h = buf.numpy()
            return h[L + 2 * Ttot:].reshape(R, -1), h[L:L + 2 * Ttot].reshape(2, Ttot), h[:L]
        t = launch.tables
        return t["runs"].numpy(), t["tok"].numpy()[6:8], t["layer_base"].numpy()

    for a, b in zip(host(fast), host(general)):
        assert np.array_equal(a, b)


def _run_tables(launch, L):
    """(runs, old|new positions, layer bases) of a fast-path run-kernel launch, or None (per-token)."""
    if launch.tables is None or launch.tables.get("runs") is None:
        return None
    runs_ptr, pos_ptr, base_ptr, R = launch.tables["run_args"]
    T = launch.tables["total"]
    buf = launch.tables["buffer"]
    h = buf.numpy()
    # where the kernel reads each table (the builders may lay the buffer out differently)
    runs, pos, base = ((ptr - buf.data_ptr()) // 8 for ptr in (runs_ptr, pos_ptr, base_ptr))
    return h[runs:runs + 7 * R].reshape(R, 7).copy(), h[pos:pos + 2 * T].copy(), h[base:base + L].copy()


@pytest.mark.parametrize("with_rope", [True, False])
def test_compiled_run_builder_matches_numpy(monkeypatch, with_rope):
    """The compiled run-table builder against the NumPy path on random restores: runs across items
    and blocks, gaps, skipped tokens, unsorted slots, out-of-range positions (its fallbacks), K and V
    in different block arrangements; the same tables, the same choice of kernel, the same errors."""
    import importlib

    import numpy as np

    place_mod = importlib.import_module("kmesh_gpu.place")
    from kmesh_gpu import _backend, _host_tables

    if _host_tables.builder() is None:
        pytest.fail("Numba is a dependency: the compiled run builder must be available")
    monkeypatch.setattr(_backend, "choose", lambda backend, device: "cupy")
    L, H, D = 2, 2, 64
    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(11)
    seen = {"runs": 0, "per-token": 0, "error": 0, "compiled": 0}
    compiled_runs = place_mod._compiled_runs

    def counted(*args):
        launch = compiled_runs(*args)
        seen["compiled"] += launch is not None
        return launch

    monkeypatch.setattr(place_mod, "_compiled_runs", counted)
    for trial in range(60):
        N = int(rng.choice([8, 16, 32]))
        layout = KVLayout.from_vllm(["NHD", "HND", "LBHNC"][trial % 3], num_layers=L, num_blocks=24, block_size=N,
                                    num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
        rope = RopeSpec(D, D, 10000.0, bool(trial % 2), MAXPOS, torch.bfloat16) if with_rope else None
        T = [int(t) for t in rng.integers(0, 40, int(rng.integers(1, 5)))]
        if sum(T) == 0:
            T[0] = 3
        total = sum(T)
        start = int(rng.integers(0, layout.num_slots - total))
        sl = np.arange(start, start + total, dtype=np.int64)
        kind = trial % 6
        if kind == 1:  # gaps
            sl = np.sort(rng.choice(layout.num_slots, total, replace=False)).astype(np.int64)
        elif kind == 2:  # a skipped token
            sl[int(rng.integers(0, total))] = -1
        elif kind == 3:  # distinct but not increasing
            sl = rng.permutation(sl)
        elif kind == 4:  # a duplicate
            sl[-1] = sl[0]
        kvs = [_segment(torch.bfloat16, t, gen, L=L, H=H, D=D) for t in T]
        slots = list(torch.split(torch.from_numpy(sl), T))
        olds = [torch.randint(0, MAXPOS, (t,), generator=gen) for t in T]
        news = [torch.randint(0, MAXPOS, (t,), generator=gen) for t in T]
        if kind == 5 and with_rope:
            news[-1 if T[-1] else 0][...] = MAXPOS  # out of range (on an empty item: nothing)
        cache = layout.allocate(fill=0)
        kw = dict(rope=rope, old_positions=olds, new_positions=news) if with_rope else {}
        out = {}
        for compiled in (True, False):
            monkeypatch.setattr(place_mod, "_COMPILED", compiled)
            try:
                out[compiled] = _run_tables(place_mod.prepare_place_many(kvs, cache, layout, slots, **kw), L)
            except LayoutError as err:
                out[compiled] = str(err)
        a, b = out[True], out[False]
        if isinstance(b, str) or b is None:
            seen["error" if isinstance(b, str) else "per-token"] += 1
            assert a == b
        else:
            seen["runs"] += 1
            assert a is not None and all(np.array_equal(x, y) for x, y in zip(a, b))
    # both kernels' choices were exercised, and most run tables came from the compiled builder
    assert seen["runs"] >= 10 and seen["per-token"] >= 3 and seen["compiled"] >= 5
    if with_rope:
        assert seen["error"] >= 3


@pytest.mark.parametrize("kind", ["runs", "per-token"])
def test_prepare_at_addresses_builds_what_views_build(monkeypatch, kind):
    """The restore routes' preparation from addresses in their staging buffer builds the same launch
    tables as prepare_place_many on views of that buffer, and declines (None) what it does not cover."""
    import importlib

    import numpy as np

    place_mod = importlib.import_module("kmesh_gpu.place")
    from kmesh_gpu import _backend

    monkeypatch.setattr(_backend, "choose", lambda backend, device: "cupy")  # the CUDA backend's tables
    gen = torch.Generator().manual_seed(5)
    L, H, D = 2, 2, 64  # rows the run kernel takes
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=16, block_size=16, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16)
    rope = RopeSpec(D, D, 10000.0, True, MAXPOS, torch.bfloat16)
    T = (32, 24, 40)
    kvs = [_segment(torch.bfloat16, t, gen, L=L, H=H, D=D) for t in T]
    # the items end to end in one buffer, as a restore's staging buffer holds them
    sizes = [kv.numel() * 2 for kv in kvs]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    buffer = torch.cat([kv.reshape(-1).view(torch.uint8) for kv in kvs])
    views = [buffer[o:o + n].view(torch.bfloat16).view(kv.shape) for o, n, kv in zip(offsets, sizes, kvs)]
    if kind == "runs":
        slots = list(torch.split(torch.arange(16, 16 + sum(T), dtype=torch.int64), T))
    else:  # scattered slots: the per-token kernel's tables
        slots = list(torch.split(torch.randperm(layout.num_slots, generator=gen)[:sum(T)], T))
    olds = [torch.randint(0, MAXPOS, (t,), generator=gen) for t in T]
    news = [torch.randint(0, MAXPOS, (t,), generator=gen) for t in T]
    cache = layout.allocate(fill=0)
    kw = dict(rope=rope, old_positions=olds, new_positions=news)
    addresses = [buffer.data_ptr() + o for o in offsets]
    shapes = [kv.shape for kv in kvs]
    at = place_mod._prepare_at(addresses, shapes, torch.bfloat16, buffer.device, cache, layout, slots, **kw)
    ref = place_mod.prepare_place_many(views, cache, layout, slots, **kw)
    assert at is not None and set(at.tables) == set(ref.tables)
    if kind == "runs":
        assert at.tables["runs"] is not None
        assert all(np.array_equal(x, y) for x, y in zip(_run_tables(at, L), _run_tables(ref, L)))
    else:
        assert at.tables.get("runs") is None
        for name, value in ref.tables.items():
            if isinstance(value, torch.Tensor):
                a, b = at.tables[name].contiguous(), value.contiguous()
                assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), name  # bit for bit
    # what it does not cover: the caller then prepares from views
    bad_shape = [(2, L + 1, t, H, D) for t in T]
    assert place_mod._prepare_at(addresses, bad_shape, torch.bfloat16, buffer.device, cache, layout, slots,
                                 **kw) is None
    assert place_mod._prepare_at(addresses, shapes, torch.float16, buffer.device, cache, layout, slots, **kw) is None
    assert place_mod._prepare_at(addresses, shapes, torch.bfloat16, torch.device("meta"), cache, layout, slots,
                                 **kw) is None
    assert place_mod._prepare_at(addresses[:2], shapes, torch.bfloat16, buffer.device, cache, layout, slots,
                                 **kw) is None


@pytest.mark.parametrize("case", ["dup", "range", "neg", "pos", "dtype", "length", "kv", "kscale"])
def test_fast_path_bad_inputs_raise_like_general(case):
    gen = torch.Generator().manual_seed(9)
    layout = KVLayout.from_vllm("NHD", num_layers=DIMS["L"], num_blocks=DIMS["B"], block_size=DIMS["N"],
                                num_kv_heads=DIMS["H"], head_size=DIMS["D"], dtype=torch.bfloat16)
    rope = _rope("neox", torch.bfloat16)
    kvs, slots, olds, news = _fast_batch(gen, layout, skip=False)
    kw = {}
    if case == "dup":
        slots[2][1] = slots[0][3]
    elif case == "range":
        slots[1][0] = layout.num_slots
    elif case == "neg":
        slots[0][0] = -2
    elif case == "pos":
        news[2][3] = MAXPOS
    elif case == "dtype":
        olds[1] = olds[1].to(torch.int32)
    elif case == "length":
        slots[2] = slots[2][:-1]
    elif case == "kv":
        kvs[1] = kvs[1].float()
    else:
        kw = dict(k_scale=0.5)

    def run():
        cache = layout.allocate(fill=POISON)
        before = cache.clone()
        with pytest.raises(LayoutError) as err:
            place_many(kvs, cache, layout, slots, rope=rope, old_positions=olds, new_positions=news,
                       backend="warp", **kw)
        assert torch.equal(_bits(cache), _bits(before))
        return str(err.value)

    fast, general = _fast_vs_general(run)
    assert fast == general


def test_runs_split_matches_a_loop():
    """_run_rows against a token-by-token loop: random slots, skipped tokens, item changes, caps."""
    import numpy as np

    from kmesh_gpu._place_tables import _run_rows

    def loop(slots, item, N, cap):
        out = []
        for t in range(slots.size):
            s = int(slots[t])
            if s < 0:
                continue
            if (t > 0 and slots[t - 1] >= 0 and item[t] == item[t - 1] and s == slots[t - 1] + 1 and s % N
                    and (cap >= N or s % cap)):
                out[-1][1] += 1
            else:
                out.append([t, 1])
        return out

    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(0, 60))
        N, cap = int(rng.choice([4, 5, 12, 16])), int(rng.choice([1, 3, 8, 16, 32]))
        if rng.random() < 0.3:
            sl = rng.integers(-1, 120, n)
        else:
            sl = np.arange(n) + int(rng.integers(0, 40))
            sl[rng.random(n) < 0.1] = -1
        sl = sl.astype(np.int64)
        item = np.sort(rng.integers(0, 4, n))
        first, length = _run_rows(sl, item, N, cap)
        assert [list(r) for r in zip(first.tolist(), length.tolist())] == loop(sl, item, N, cap)


@pytest.mark.gpu
def test_driver_launch_matches_cupy_launch(monkeypatch):
    """Kernels launched through cuLaunchKernel (kmesh_gpu._launch) write the same bits as CuPy's
    launch of the same kernels, and the driver path is the one taken by default."""
    from kmesh_gpu import _launch

    accepted = []
    real = _launch.launch

    def counted(*args):
        ok = real(*args)
        accepted.append(ok)
        return ok

    monkeypatch.setattr(_launch, "launch", counted)
    outs = {}
    for enabled in (True, False):
        monkeypatch.setattr(_launch, "ENABLED", enabled)
        accepted.clear()
        outs[enabled] = _run_kernel_case(torch.bfloat16, 64, True, gather_too=False)
        if enabled:  # the per-token and the run kernel
            assert len(accepted) >= 2 and all(accepted)
        else:
            assert accepted and not any(accepted)
    for name in ("cupy-tokens", "cupy-runs"):
        assert torch.equal(outs[True][name][0], outs[False][name][0])


def test_cupy_launcher_reads_the_kernel_shapes_from_the_place_module():
    """_place_cupy imports on a CPU machine and reads the tunable shapes from kmesh_gpu.place (the
    module, not the package's function of that name), where the tools set them."""
    import importlib

    from kmesh_gpu import _place_cupy

    place_mod = importlib.import_module("kmesh_gpu.place")
    assert _place_cupy.P is place_mod
    for name in ("_VEC_PER", "_VEC_LPT", "_RUN_GROUPS", "_RUN_HEADS", "_RUN_VPL", "_RUN_KVF", "_RUN_UNITS"):
        assert isinstance(getattr(_place_cupy.P, name), int)


def test_driver_helpers_decline_without_a_driver_or_a_function(monkeypatch):
    """_launch declines (returns False, queues nothing) when switched off, when the function has no
    CUfunction, or when an argument does not fit 64 bits; callers then take CuPy's or torch's path."""
    from kmesh_gpu import _launch

    class NoPtr:
        pass

    assert _launch.launch(NoPtr(), (1,), (32,), 0, (1, 2)) is False
    assert _launch.record_event(0, 0) is False and _launch.wait_event(0, 0) is False  # no event: refused
    monkeypatch.setattr(_launch, "ENABLED", False)
    assert _launch.copy_htod(0, 0, 16, 0) is False
    assert _launch.record_event(1, 0) is False and _launch.wait_event(0, 1) is False

    class Fn:
        ptr = 1234

    monkeypatch.setattr(_launch, "ENABLED", True)
    if _launch._driver() is not None:  # a machine with libcuda: an argument over 63 bits is declined
        assert _launch.launch(Fn(), (1,), (32,), 0, (1 << 64,)) is False


def _gate_case(device: str, backend: str):
    """A placement of 300 full blocks (300 runs of 16 tokens, RoPE shift) prepared, not run."""
    from kmesh_gpu.place import prepare_place_many

    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=320, block_size=16, num_kv_heads=2, head_size=16,
                                dtype=torch.bfloat16)
    rope = RopeSpec(16, 16, 10000.0, True, 8192, torch.bfloat16)
    T = 16 * 300
    kv = _segment(torch.bfloat16, T, torch.Generator().manual_seed(3), L=2, H=2, D=16, device=device)
    slots, old, new = torch.arange(T), torch.arange(T) + 7, torch.arange(T) + 2000
    ref = layout.allocate(device, fill=POISON)
    place(kv, ref, layout, slots.to(device), rope=rope, old_positions=old.to(device), new_positions=new.to(device),
          backend="torch")
    cache = layout.allocate(device, fill=POISON)
    launch = prepare_place_many([kv], cache, layout, [slots], rope=rope, old_positions=[old], new_positions=[new],
                                backend=backend)
    return launch, cache, ref


def test_gate_declines_a_placement_without_a_device_run_table():
    """``_Launch.gate`` queues nothing (and says so) where there is no run table on a device: the
    routes then compare the roots on the host before placing."""
    launch, cache, ref = _gate_case("cpu", "torch")
    before = cache.clone()
    assert launch.gate(0, 0, 32, 0) is False
    assert torch.equal(_bits(cache), _bits(before))
    launch.run()
    assert torch.equal(_bits(cache), _bits(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("differ", [None, 0, 9215], ids=["equal", "first byte differs", "last byte differs"])
def test_gate_empties_the_run_table_unless_the_bytes_match(differ):
    """``_Launch.gate`` (the routes' device-side verdict, csrc/gate.cu), queued before the run: equal
    bytes leave the placement as it was; one differing byte anywhere in 9 KiB (more bytes, and a
    table of more runs, than the gate's block has threads) makes the run kernel write nothing."""
    launch, cache, ref = _gate_case("cuda", "cupy")
    assert launch.tables.get("runs") is not None and launch.tables["run_args"][3] == 300
    before = cache.clone()
    got = torch.randint(0, 256, (9216,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)).cuda()
    want = got.clone()
    if differ is not None:
        want[differ] ^= 0x40
    assert launch.gate(got.data_ptr(), want.data_ptr(), got.numel(), torch.cuda.current_stream().cuda_stream)
    launch.run()
    torch.cuda.synchronize()
    assert torch.equal(_bits(cache), _bits(ref if differ is None else before))
