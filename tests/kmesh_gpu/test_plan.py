"""kmesh_gpu.PlacementPlan through its public names: a plan prepared once places what place_many
places, bit for bit, from per-item index lists, one flat array or a StagedSegments buffer, with
either kernel (KernelShape(run_kernel=False): the per-token kernels); every bad input is refused by
name with nothing written (a plan always checks its slots); Launch.gate and compiled_launch decline
where they do not apply. Which internal path ran is asserted in test_plan_paths.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kmesh_gpu import (KernelShape, KVLayout, LayoutError, PlacementPlan, RopeSpec, StagedSegments, gather, place,
                       place_many)
from tests.helpers.devices import DEVICES, backends_for

POISON = 0xA5
MAXPOS = 512
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _segment(dtype, T, gen, L, H, D, device="cpu"):
    x = torch.randn(2, L, T, H, D, generator=gen) * 2
    if dtype == torch.uint8:
        return x.to(torch.float8_e4m3fn).view(torch.uint8).to(device)
    return x.to(dtype).to(device)


def _batch(device, *, L=3, H=2, D=64, N=16, B=24, T=(40, 24, 57), seed=4, rope=True, dtype=torch.bfloat16):
    """Three items in consecutive slots from a mid-block start (the usual restore), one skipped
    token whose positions are out of range (never read: accepted)."""
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=dtype)
    spec = RopeSpec(D, D, 1e6, True, MAXPOS, torch.bfloat16 if dtype == torch.uint8 else dtype) if rope else None
    kvs = [_segment(dtype, t, gen, L, H, D, device) for t in T]
    slots = np.arange(5, 5 + sum(T), dtype=np.int64)
    slots[50] = -1
    old = np.random.default_rng(seed).integers(0, MAXPOS, sum(T)).astype(np.int64)
    new = np.random.default_rng(seed + 1).integers(0, MAXPOS, sum(T)).astype(np.int64)
    old[50] = MAXPOS + 9
    return layout, spec, T, kvs, slots, old, new


def _split(values, counts, device="cpu"):
    return [t.to(device) for t in torch.split(torch.from_numpy(values), list(counts))]


def _reference(layout, spec, T, kvs, slots, old, new, device):
    ref = layout.allocate(device, fill=POISON)
    kw = dict(rope=spec, old_positions=_split(old, T, device), new_positions=_split(new, T, device)) if spec else {}
    place_many(kvs, ref, layout, _split(slots, T, device), backend="torch", **kw)
    return ref


# ---------------------------------------------------------------------------------- bits
@pytest.mark.parametrize("device", DEVICES)
def test_a_prepared_launch_places_what_place_many_places_and_runs_again(device):
    layout, spec, T, kvs, slots, old, new = _batch(device)
    ref = _reference(layout, spec, T, kvs, slots, old, new, device)
    for backend in backends_for(device):
        cache = layout.allocate(device, fill=POISON)
        plan = PlacementPlan(cache, layout, rope=spec, backend=backend)
        assert plan.backend == backend and plan.device == cache.device
        launch = plan.prepare(kvs, _split(slots, T), old_positions=_split(old, T), new_positions=_split(new, T))
        assert not launch.empty
        before = cache.clone()
        assert torch.equal(_bits(cache), _bits(before))  # prepared, not run: nothing written yet
        launch.run()
        launch.run()  # a launch may run again (benchmarks time run() alone): the same bits
        assert torch.equal(_bits(cache), _bits(ref)), backend


@pytest.mark.parametrize("device", DEVICES)
def test_one_flat_index_array_equals_per_item_lists(device):
    """Slots and positions as one int64 array of all items' values (numpy, a CPU tensor, a tensor
    on the cache's device) place what per-item tensors place."""
    layout, spec, T, kvs, slots, old, new = _batch(device)
    ref = _reference(layout, spec, T, kvs, slots, old, new, device)
    forms = {"numpy": lambda a: a, "cpu-tensor": torch.from_numpy,
             "device-tensor": lambda a: torch.from_numpy(a).to(device),
             "lists": lambda a: _split(a, T), "device-lists": lambda a: _split(a, T, device)}
    for backend in backends_for(device):
        for name, form in forms.items():
            cache = layout.allocate(device, fill=POISON)
            PlacementPlan(cache, layout, rope=spec, backend=backend).place(
                kvs, form(slots), old_positions=form(old), new_positions=form(new))
            assert torch.equal(_bits(cache), _bits(ref)), (backend, name)
        # one item, one tensor: the flat form of a single segment
        cache, one = layout.allocate(device, fill=POISON), layout.allocate(device, fill=POISON)
        s = torch.arange(30, 30 + T[0], device=device)
        PlacementPlan(cache, layout, backend=backend).place(kvs[:1], s)
        place(kvs[0], one, layout, s, backend="torch")
        assert torch.equal(_bits(cache), _bits(one)), backend


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rd,neox", [(64, True), (32, True), (64, False), (32, False), (None, None)],
                         ids=["rd64-neox", "rd32-neox", "rd64-gptj", "rd32-gptj", "none"])
def test_run_kernel_and_per_token_kernels_give_the_same_bits(device, dtype, rd, neox):
    """The default KernelShape (the run kernel where it applies: CUDA, 16-byte rows) and
    KernelShape(run_kernel=False) (the per-token kernels) against the torch reference: slots in
    runs that start mid-block and cross blocks, a shuffled tail, skipped tokens; gather too."""
    dt = DTYPES[dtype]
    L, H, D, N, B, Tn = 3, 2, 64, 16, 12, 45
    gen = torch.Generator().manual_seed(7)
    layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=dt)
    kv = _segment(dt, Tn, gen, L, H, D, device)
    slots = torch.cat([torch.arange(5, 25), torch.arange(7 * N + 3, 7 * N + 3 + 24), torch.tensor([-1])])[:Tn]
    slots[30] = -1
    slots = slots.to(device)
    old = torch.randint(0, MAXPOS, (Tn,), generator=gen).to(device)
    new = torch.randint(0, MAXPOS, (Tn,), generator=gen).to(device)
    rope = RopeSpec(D, rd, 10000.0, neox, MAXPOS, torch.bfloat16 if dt == torch.uint8 else dt) if rd else None
    k_scale = 0.75 if dt == torch.uint8 and rope is not None else None
    kw = dict(old_positions=[old], new_positions=[new]) if rope else {}
    variants = [("torch", KernelShape())] + [(b, s) for b in backends_for(device) if b != "torch"
                                             for s in (KernelShape(), KernelShape(run_kernel=False))]
    outs = {}
    for backend, shape in variants:
        cache = layout.allocate(device, fill=POISON)
        plan = PlacementPlan(cache, layout, rope=rope, backend=backend, shape=shape)
        plan.place([kv], [slots], k_scale=k_scale, **kw)
        back = None
        if rope is None:
            back = torch.full_like(kv, 0x5A if dt == torch.uint8 else 7)
            plan.gather(slots, out=back)
        outs[(backend, shape.run_kernel)] = (_bits(cache).cpu(), None if back is None else _bits(back).cpu())
    ref_cache, ref_back = outs.pop(("torch", True))
    for name, (got, back) in outs.items():
        assert torch.equal(ref_cache, got), f"{name}: {(ref_cache != got).sum()} bytes differ from torch"
        if ref_back is not None:
            assert torch.equal(ref_back, back), f"{name}: gather differs from torch"


def test_kernel_shape_is_a_frozen_value():
    """KernelShape holds the kernels' compile-time constants (no module switches): a frozen,
    hashable value with the measured defaults; a plan refuses anything else."""
    shape = KernelShape()
    assert shape.run_kernel is True and shape == KernelShape() and hash(shape) == hash(KernelShape())
    for field in dataclasses.fields(KernelShape):
        assert isinstance(getattr(shape, field.name), (int, bool)), field.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.run_kernel = False
    assert KernelShape(run_kernel=False) != shape
    layout = KVLayout.from_vllm("NHD", num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_size=16,
                                dtype=torch.float32)
    with pytest.raises(LayoutError, match="shape: expected a KernelShape"):
        PlacementPlan(layout.allocate(fill=0), layout, shape={"run_kernel": False})
    for bad, match in ((dict(run_groups=0), "run_groups"), (dict(vec_per=-1), "vec_per"),
                       (dict(run_units=2.0), "run_units"), (dict(vec_layers=True), "vec_layers"),
                       (dict(run_kernel=1), "run_kernel"), (dict(run_kv_fused=None), "run_kv_fused")):
        with pytest.raises(LayoutError, match=f"shape.{match}"):
            KernelShape(**bad)


# ---------------------------------------------------------------------------------- StagedSegments
def _staged(kvs, *, pad: int = 0, device="cpu"):
    """The items end to end in one byte buffer (each at a 16-byte boundary), as a restore stages them."""
    sizes = [kv.numel() * kv.element_size() for kv in kvs]
    offsets, at = [], pad
    for n in sizes:
        offsets.append(at)
        at += -(-n // 16) * 16
    buffer = torch.zeros(at + 16, dtype=torch.uint8, device=device)
    for kv, o, n in zip(kvs, offsets, sizes):
        buffer[o:o + n].copy_(kv.reshape(-1).view(torch.uint8))
    return StagedSegments(buffer, tuple(offsets), tuple(kv.shape[2] for kv in kvs), kvs[0].dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_staged_segments_place_what_their_views_place(device):
    layout, spec, T, kvs, slots, old, new = _batch(device)
    ref = _reference(layout, spec, T, kvs, slots, old, new, device)
    staged = _staged(kvs, pad=32, device=device)
    for view, kv in zip(staged.views(layout), kvs):
        assert torch.equal(_bits(view), _bits(kv))
    for backend in backends_for(device):
        cache = layout.allocate(device, fill=POISON)
        PlacementPlan(cache, layout, rope=spec, backend=backend).place(staged, slots, old_positions=old,
                                                                         new_positions=new)
        assert torch.equal(_bits(cache), _bits(ref)), backend


@pytest.mark.parametrize("backend", ["torch", "warp"])
def test_staged_segments_outside_their_buffer_are_refused(backend):
    """Every segment must lie inside the buffer, at an aligned address, outside the cache."""
    layout, spec, T, kvs, slots, old, new = _batch("cpu", rope=False)
    good = _staged(kvs)
    buf, offs, counts = good.buffer, good.offsets, good.token_counts
    cache = layout.allocate(fill=POISON)
    plan = PlacementPlan(cache, layout, backend=backend)
    inside = cache.view(-1).view(torch.uint8)
    bad = {
        "past the end": (StagedSegments(buf, offs[:2] + (buf.numel() - 64,), counts, torch.bfloat16), "exceed"),
        "count too large": (StagedSegments(buf, offs, counts[:2] + (counts[2] + 1,), torch.bfloat16), "exceed"),
        "negative offset": (StagedSegments(buf, (-2,) + offs[1:], counts, torch.bfloat16), "non-negative"),
        "odd offset": (StagedSegments(buf, (offs[0] + 1,) + offs[1:], counts, torch.bfloat16), "multiple of 2"),
        "odd address": (StagedSegments(buf[1:], offs, counts, torch.bfloat16), "not a multiple of 2"),
        "float offset": (StagedSegments(buf, (0.0,) + offs[1:], counts, torch.bfloat16), "integers"),
        "numpy count": (StagedSegments(buf, offs, (np.int64(counts[0]),) + counts[1:], torch.bfloat16), "integers"),
        "fewer offsets": (StagedSegments(buf, offs[:2], counts, torch.bfloat16), "2 offsets for 3"),
        "dtype": (StagedSegments(buf, offs, counts, torch.float16), "segments.dtype"),
        "buffer dtype": (StagedSegments(buf.view(torch.int16), offs, counts, torch.bfloat16), "segments.buffer"),
        "buffer 2-D": (StagedSegments(buf.view(2, -1), offs, counts, torch.bfloat16), "segments.buffer"),
        "buffer strided": (StagedSegments(buf[::2], offs, counts, torch.bfloat16), "segments.buffer"),
        "buffer device": (StagedSegments(buf.to("meta"), offs, counts, torch.bfloat16), "device"),
        "inside the cache": (StagedSegments(inside, (0,), (4,), torch.bfloat16), "shares memory with the cache"),
    }
    before = cache.clone()
    for name, (staged, match) in bad.items():
        sl = slots if name != "inside the cache" else np.arange(100, 104, dtype=np.int64)
        if name == "count too large":
            sl = np.append(slots, 200)
        with pytest.raises(LayoutError, match=match):
            plan.place(staged, sl)
        assert torch.equal(_bits(cache), _bits(before)), name
    plan.place(good, slots)  # and the good one is placed
    assert not torch.equal(_bits(cache), _bits(before))


# ---------------------------------------------------------------------------------- bad input
def _bad_batch():
    layout = KVLayout.from_vllm("NHD", num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_size=16,
                                dtype=torch.bfloat16)
    rope = RopeSpec(16, 16, 10000.0, True, MAXPOS, torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    T = (5, 7, 4)
    kvs = [_segment(torch.bfloat16, t, gen, 3, 2, 16) for t in T]
    perm = torch.randperm(layout.num_slots, generator=gen)[:sum(T)]
    slots = list(torch.split(perm.clone(), T))
    olds = [torch.randint(0, MAXPOS, (t,), generator=gen) for t in T]
    news = [torch.randint(0, MAXPOS, (t,), generator=gen) for t in T]
    return layout, rope, kvs, slots, olds, news


@pytest.mark.parametrize("backend", ["torch", "warp"])
@pytest.mark.parametrize("case,match", [
    ("dup", "same destination slot"), ("range", r"slots\[1\]: expected values in \[-1, 24\)"),
    ("neg", r"slots\[0\]: expected values"), ("pos", r"new_positions\[2\]: positions must lie in \[0, 512\)"),
    ("dtype", r"old_positions\[1\]: expected int64\[7\]"), ("length", r"slots\[2\]: expected int64\[4\]"),
    ("kv", r"kvs\[1\]: expected dtype"), ("kscale", "k_scale: only meaningful for fp8"),
    ("missing", "both are required"),
])
def test_bad_input_to_a_plan_is_refused_by_name_and_writes_nothing(backend, case, match):
    """As per-item lists and as one flat array: refused alike (the flat form names the argument,
    the lists the item), nothing written."""
    layout, rope, kvs, slots, olds, news = _bad_batch()
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
    elif case == "kscale":
        kw = dict(k_scale=0.5)
    else:
        olds = None
    cache = layout.allocate(fill=POISON)
    before = cache.clone()
    plan = PlacementPlan(cache, layout, rope=rope, backend=backend)
    for form in ("lists", "flat"):
        args, flat_match = (slots, olds, news), match
        if form == "flat":  # values are still named by item; a wrong type or length by the argument
            args = tuple(None if a is None else torch.cat(a).numpy() for a in args)
            if case == "dtype":
                args = (args[0], args[1].astype(np.int32), args[2])
            flat_match = {"dtype": r"old_positions: expected a list of 3 int64 tensors or one int64\[16\]",
                          "length": r"slots: expected int64\[16\] \(all items' values\)"}.get(case, match)
        with pytest.raises(LayoutError, match=flat_match):
            plan.place(kvs, args[0], old_positions=args[1], new_positions=args[2], **kw)
        with pytest.raises(LayoutError, match=flat_match):
            plan.prepare(kvs, args[0], old_positions=args[1], new_positions=args[2], **kw)
        assert torch.equal(_bits(cache), _bits(before)), form


@pytest.mark.parametrize("backend", ["torch", "warp"])
def test_a_plan_always_checks_its_slots(backend):
    """There is no "slots already checked" promise: a plan refuses duplicate and out-of-range slots
    on every placement (the hundredth like the first), as it refuses bad positions and shapes."""
    layout = KVLayout.from_vllm("LBHNC", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=16,
                                dtype=torch.bfloat16)
    rope = RopeSpec(16, 16, 10000.0, True, 64, torch.bfloat16)
    kv = torch.randn(2, 2, 3, 2, 16).to(torch.bfloat16)
    cache = layout.allocate(fill=POISON)
    plan = PlacementPlan(cache, layout, rope=rope, backend=backend)
    slots, old, new = torch.tensor([0, 5, 2]), torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    ref = layout.allocate(fill=POISON)
    place_many([kv], ref, layout, [slots], rope=rope, old_positions=[old], new_positions=[new], backend="torch")
    for _ in range(3):
        plan.prepare([kv], [slots], old_positions=[old], new_positions=[new]).run()
    assert torch.equal(_bits(cache), _bits(ref))
    before = cache.clone()
    for sl, o, n, match in (([0, 0, 1], old, new, "more than once"), ([0, 1, 16], old, new, "slots: expected values"),
                            ([0, 1, 2], old, torch.tensor([4, 5, 99999]), "new_positions"),
                            ([0, 1], old, new, r"slots: expected int64\[3\]")):
        with pytest.raises(LayoutError, match=match):
            plan.prepare([kv], [torch.tensor(sl)], old_positions=[o], new_positions=[n])
    assert torch.equal(_bits(cache), _bits(before))


def test_a_plan_checks_its_cache_layout_and_rope_once_and_positions_every_time():
    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=16,
                                dtype=torch.bfloat16)
    rope = RopeSpec(16, 16, 10000.0, True, 64, torch.bfloat16)
    cache = layout.allocate(fill=POISON)
    before = cache.clone()
    for args, kw, match in (((cache, "NHD"), {}, "layout: expected a KVLayout"),
                            ((cache.float(), layout), {}, "cache: expected dtype"),
                            ((cache[:1], layout), {}, "tensor spans"),
                            ((cache, layout), dict(rope=rope.to_dict()), "rope: expected a RopeSpec"),
                            ((cache, layout), dict(rope=RopeSpec(16, 16, 1e4, True, 64, torch.float16)), "rope: dtype"),
                            ((cache, layout), dict(backend="triton"), "backend")):
        with pytest.raises(Exception, match=match) as err:
            PlacementPlan(*args, **kw)
        assert err.type.__name__ in ("LayoutError", "BackendError")
    kv = torch.randn(2, 2, 3, 2, 16).to(torch.bfloat16)
    sl = torch.tensor([0, 1, 2])
    with pytest.raises(LayoutError, match="make the plan with rope="):
        PlacementPlan(cache, layout).place([kv], [sl], old_positions=[sl], new_positions=[sl])
    with pytest.raises(LayoutError, match="both are required"):
        PlacementPlan(cache, layout, rope=rope).place([kv], [sl])
    assert torch.equal(_bits(cache), _bits(before))


@pytest.mark.parametrize("backend", ["torch", "warp"])
def test_nothing_to_place_is_an_empty_launch(backend):
    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=16,
                                dtype=torch.bfloat16)
    cache = layout.allocate(fill=POISON)
    before = cache.clone()
    plan = PlacementPlan(cache, layout, backend=backend)
    kv = torch.randn(2, 2, 3, 2, 16).to(torch.bfloat16)
    for segments, slots in (([], []), ([kv[:, :, :0].contiguous()], [torch.zeros(0, dtype=torch.int64)])):
        launch = plan.prepare(segments, slots)
        assert launch.empty and not launch.uses_run_kernel
        launch.run()
    plan.place([kv], [torch.full((3,), -1)])  # every token skipped: a launch with nothing to write, or none
    assert torch.equal(_bits(cache), _bits(before))


# ---------------------------------------------------------------------------------- gate, compiled launch
def _gate_case(device: str, backend: str):
    """A placement of 300 full blocks (300 runs of 16 tokens, RoPE shift) prepared, not run."""
    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=320, block_size=16, num_kv_heads=2, head_size=16,
                                dtype=torch.bfloat16)
    rope = RopeSpec(16, 16, 10000.0, True, 8192, torch.bfloat16)
    Tn = 16 * 300
    kv = _segment(torch.bfloat16, Tn, torch.Generator().manual_seed(3), 2, 2, 16, device)
    slots, old, new = torch.arange(Tn), torch.arange(Tn) + 7, torch.arange(Tn) + 2000
    ref = layout.allocate(device, fill=POISON)
    place(kv, ref, layout, slots.to(device), rope=rope, old_positions=old.to(device), new_positions=new.to(device),
          backend="torch")
    cache = layout.allocate(device, fill=POISON)
    launch = PlacementPlan(cache, layout, rope=rope, backend=backend).prepare([kv], [slots], old_positions=[old],
                                                                             new_positions=[new])
    return launch, cache, ref


@pytest.mark.parametrize("backend", ["torch", "warp"])
def test_gate_declines_a_placement_without_a_device_run_table(backend):
    """``Launch.gate`` queues nothing (and says so) where there is no run table on a device: the
    routes then compare the roots on the host before placing."""
    launch, cache, ref = _gate_case("cpu", backend)
    before = cache.clone()
    assert not launch.uses_run_kernel
    assert launch.gate(0, 0, 32, 0) is False
    assert torch.equal(_bits(cache), _bits(before))
    launch.run()
    assert torch.equal(_bits(cache), _bits(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("differ", [None, 0, 9215], ids=["equal", "first byte differs", "last byte differs"])
def test_gate_empties_the_run_table_unless_the_bytes_match(differ):
    """``Launch.gate`` (the routes' device-side verdict, csrc/gate.cu), queued before the run: equal
    bytes leave the placement as it was; one differing byte anywhere in 9 KiB (more bytes, and a
    table of more runs, than the gate's block has threads) makes the run kernel write nothing."""
    launch, cache, ref = _gate_case("cuda", "cupy")
    assert launch.uses_run_kernel
    before = cache.clone()
    got = torch.randint(0, 256, (9216,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)).cuda()
    want = got.clone()
    if differ is not None:
        want[differ] ^= 0x40
    assert launch.gate(got.data_ptr(), want.data_ptr(), got.numel(), torch.cuda.current_stream().cuda_stream)
    launch.run()
    torch.cuda.synchronize()
    assert torch.equal(_bits(cache), _bits(ref if differ is None else before))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_launch_only_where_the_run_kernel_serves(device):
    """A compiled loop of the caller's own gets the run kernel's constants for a CUDA plan of the
    cupy backend, and ``None`` for anything else (CPU, the per-token kernels, fp8)."""
    layout, spec, T, kvs, slots, old, new = _batch(device)
    cache = layout.allocate(device, fill=POISON)
    for backend in backends_for(device):
        if backend != "cupy":
            assert PlacementPlan(cache, layout, rope=spec, backend=backend).compiled_launch() is None
    assert PlacementPlan(cache, layout, rope=spec, shape=KernelShape(run_kernel=False)).compiled_launch() is None
    fp8 = KVLayout.from_vllm("NHD", num_layers=3, num_blocks=4, block_size=16, num_kv_heads=2, head_size=64,
                             dtype=torch.uint8)
    assert PlacementPlan(fp8.allocate(device, fill=0), fp8).compiled_launch() is None
    if device == "cuda" and "cupy" in backends_for(device):
        got = PlacementPlan(cache, layout, rope=spec, backend="cupy").compiled_launch()
        assert got is not None and got.device_index == cache.device.index
        assert got.storage_dtype == torch.bfloat16 and got.kv_shape == (3, 2, 64)
        assert got.layer_base.tolist() == [cache.data_ptr() + i * layout.k_strides[0] * 2 for i in range(3)]
        for a in (got.kernel, got.template, got.params, got.layer_base):
            assert not a.flags.writeable


@pytest.mark.parametrize("device", DEVICES)
def test_gather_through_a_plan_reads_what_was_placed(device):
    layout, spec, T, kvs, slots, old, new = _batch(device, rope=False)
    for backend in backends_for(device):
        cache = layout.allocate(device, fill=POISON)
        plan = PlacementPlan(cache, layout, backend=backend)
        plan.place(kvs, slots)
        s = torch.from_numpy(slots[:T[0]]).to(device)
        back = plan.gather(s)
        valid = s >= 0
        assert torch.equal(_bits(back)[:, :, valid], _bits(kvs[0])[:, :, valid]), backend
        assert not bool(_bits(back)[:, :, ~valid].any())
        assert torch.equal(_bits(back), _bits(gather(cache, layout, s, backend="torch")))
