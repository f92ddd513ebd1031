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
