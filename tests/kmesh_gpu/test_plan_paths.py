"""Which internal path a placement takes (kmesh_gpu.plan and the modules behind it), and that each
path builds what the others build. The only test file that looks inside the plan.

* The run kernel's table: where it applies (the cupy backend, 16-byte rows, the default
  KernelShape) the compiled builder makes it; on CPU (the cupy backend's choice forced, so the
  tables are built as for CUDA without launching anything) it equals the NumPy reference of
  tests/helpers/runs_reference.py on random restores, and where the builder declines the per-token
  path takes over and names any error exactly as the torch backend does. StagedSegments and
  per-layer caches build the tables their views and stacked caches build.
* On a GPU (``-m gpu``): the run kernel is launched through one compiled driver call by default,
  through ctypes or CuPy where the compiled driver or the driver refuses (fault injection), with
  the same bits; ``PlacementPlan.place`` is one compiled call (gather, check, build, upload,
  launch) where it applies, declines what it does not cover (the prepared path then places or
  refuses), and never overwrites a table ring region still in use behind a slow kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kmesh_gpu import KernelShape, KVLayout, LayoutError, PlacementPlan, RopeSpec, StagedSegments, place_many
from kmesh_gpu import _backend, _facts, cuda
from tests.helpers.runs_reference import run_table

MAXPOS = 4096
POISON = 0xA5


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _segment(dtype, T, gen, L, H, D, device="cpu"):
    return (torch.randn(2, L, T, H, D, generator=gen) * 2).to(dtype).to(device)


@pytest.fixture
def fresh_facts(monkeypatch):
    """No cache facts (rings, launch templates, one-call constants) carried over from other tests."""
    monkeypatch.setattr(_facts, "_FACTS", {})


@pytest.fixture
def cupy_tables(monkeypatch, fresh_facts):
    """Plans choose the cupy backend on CPU tensors: tables are built as for CUDA (nothing runs)."""
    monkeypatch.setattr(_backend, "choose", lambda backend, device: "cupy")


def _run_tables(launch, L: int):
    """(runs, old|new positions, layer bases) of a run-kernel launch, read where the kernel reads
    them; ``None`` for a per-token launch."""
    if not launch.uses_run_kernel:
        return None
    runs_ptr, pos_ptr, base_ptr, R = launch.tables["run_args"]
    T = launch.tables["total"]
    buf = launch.tables["buffer"]
    h = buf.numpy()
    runs, pos, base = ((ptr - buf.data_ptr()) // 8 for ptr in (runs_ptr, pos_ptr, base_ptr))
    return h[runs:runs + 7 * R].reshape(R, 7).copy(), h[pos:pos + 2 * T].copy(), h[base:base + L].copy()


# ---------------------------------------------------------------------------------- which kernel
def test_the_run_kernel_is_taken_where_it_applies_and_only_there(cupy_tables):
    L, H, D, N = 3, 2, 64, 16
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=12, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16)
    rope = RopeSpec(D, D, 10000.0, True, MAXPOS, torch.bfloat16)
    kv = _segment(torch.bfloat16, 40, torch.Generator().manual_seed(1), L, H, D)
    cache = layout.allocate(fill=0)
    pos = dict(old_positions=[torch.arange(40)], new_positions=[torch.arange(40) + 9])

    def launch(slots, *, shape=KernelShape(), segments=None, lay=layout, c=cache, r=rope, **kw):
        plan = PlacementPlan(c, lay, rope=r, shape=shape)
        return plan.prepare(segments or [kv], [slots], **(pos if r is not None else {}), **kw)

    runs = torch.arange(5, 45)
    assert launch(runs).uses_run_kernel
    assert launch(runs, r=None).uses_run_kernel
    assert not launch(runs, shape=KernelShape(run_kernel=False)).uses_run_kernel
    assert not launch(torch.arange(0, 80, 2)).uses_run_kernel  # a run per token: the builder declines
    with_skips = runs.clone()
    with_skips[[3, 17]] = -1
    assert launch(with_skips).uses_run_kernel  # skipped tokens stay in the run table's builder
    assert launch(runs.flip(0)).uses_run_kernel is False  # decreasing: runs of one token each
    # a source that is not 16-byte aligned: the per-token kernel
    buf = torch.zeros(kv.numel() * 2 + 16, dtype=torch.uint8)
    buf[2:2 + kv.numel() * 2].copy_(kv.view(-1).view(torch.uint8))
    assert not launch(runs, segments=StagedSegments(buf, (2,), (40,), torch.bfloat16)).uses_run_kernel
    assert launch(runs, segments=StagedSegments(buf, (0,), (40,), torch.bfloat16)).uses_run_kernel
    # rows that are not 16-byte multiples (D = 60 in bf16): the per-token kernel
    odd = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=12, block_size=N, num_kv_heads=H, head_size=60,
                             dtype=torch.bfloat16)
    kv60 = _segment(torch.bfloat16, 40, torch.Generator().manual_seed(2), L, H, 60)
    assert not launch(runs, segments=[kv60], lay=odd, c=odd.allocate(fill=0), r=None).uses_run_kernel


def test_the_other_backends_never_take_the_run_kernel(fresh_facts):
    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                dtype=torch.bfloat16)
    kv = _segment(torch.bfloat16, 32, torch.Generator().manual_seed(3), 2, 2, 64)
    for backend in ("torch", "warp"):
        launch = PlacementPlan(layout.allocate(fill=0), layout, backend=backend).prepare([kv], [torch.arange(32)])
        assert not launch.uses_run_kernel and not launch.empty
        assert launch.gate(0, 0, 16, 0) is False


@pytest.mark.parametrize("with_rope", [True, False], ids=["rope", "copy"])
def test_run_tables_equal_the_reference_on_random_restores(cupy_tables, with_rope):
    """Runs across items and blocks, gaps, skipped tokens, unsorted and duplicate slots,
    out-of-range positions, K and V in different block arrangements: the plan's run table is the
    reference's; where the reference declines, the plan takes the per-token kernel or refuses with
    the torch backend's error."""
    L, H, D = 2, 2, 64
    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(11)
    seen = {"runs": 0, "per-token": 0, "error": 0}
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
        kvs = [_segment(torch.bfloat16, t, gen, L, H, D) for t in T]
        old = rng.integers(0, MAXPOS, total).astype(np.int64)
        new = rng.integers(0, MAXPOS, total).astype(np.int64)
        if kind == 5 and with_rope:
            new[-1] = MAXPOS  # out of range
        cache = layout.allocate(fill=0)
        kw = dict(old_positions=old, new_positions=new) if with_rope else {}
        plan = PlacementPlan(cache, layout, rope=rope)
        f = plan._f
        starts = np.cumsum([0, *T]).astype(np.int64)
        ptrs = np.array([kv.data_ptr() for kv in kvs], dtype=np.int64)
        R, ref = run_table(sl, starts, ptrs, f.run_params(f.cap), True, np.concatenate([old, new]) if with_rope
                           else np.zeros(0, dtype=np.int64))
        try:
            launch = plan.prepare(kvs, sl, **kw)
        except LayoutError as err:
            seen["error"] += 1
            assert R in (-1, -2, -3)  # the builder refused: the per-token path named the error ...
            with pytest.raises(LayoutError) as torch_err:  # ... as the torch backend names it
                PlacementPlan(cache, layout, rope=rope, backend="torch").prepare(kvs, sl, **kw)
            assert str(err) == str(torch_err.value)
            continue
        got = _run_tables(launch, L)
        if R > 0:
            seen["runs"] += 1
            assert got is not None
            runs, pos, base = got
            assert np.array_equal(runs, ref)
            if with_rope:
                assert np.array_equal(pos, np.concatenate([old, new]))
            assert np.array_equal(base, f.layer_base)
        else:
            seen["per-token"] += 1
            assert got is None and not launch.empty
    assert seen["runs"] >= 10 and seen["per-token"] >= 3
    if with_rope:
        assert seen["error"] >= 3


@pytest.mark.parametrize("kind", ["runs", "per-token"])
def test_staged_segments_build_the_tables_their_views_build(cupy_tables, kind):
    """A restore's staging buffer (StagedSegments) and tensor views of it give the same launch
    tables, run table or per-token tables, value for value."""
    gen = torch.Generator().manual_seed(5)
    L, H, D = 2, 2, 64
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=16, block_size=16, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16)
    rope = RopeSpec(D, D, 10000.0, True, MAXPOS, torch.bfloat16)
    T = (32, 24, 40)
    kvs = [_segment(torch.bfloat16, t, gen, L, H, D) for t in T]
    sizes = [kv.numel() * 2 for kv in kvs]
    offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
    buffer = torch.cat([kv.reshape(-1).view(torch.uint8) for kv in kvs])
    staged = StagedSegments(buffer, offsets, T, torch.bfloat16)
    views = staged.views(layout)
    if kind == "runs":
        slots = torch.arange(16, 16 + sum(T), dtype=torch.int64)
    else:  # scattered slots: the per-token kernel's tables
        slots = torch.randperm(layout.num_slots, generator=gen)[:sum(T)]
    old = torch.randint(0, MAXPOS, (sum(T),), generator=gen)
    new = torch.randint(0, MAXPOS, (sum(T),), generator=gen)
    plan = PlacementPlan(layout.allocate(fill=0), layout, rope=rope)
    at = plan.prepare(staged, slots, old_positions=old, new_positions=new)
    ref = plan.prepare(views, slots, old_positions=old, new_positions=new)
    assert at.uses_run_kernel == ref.uses_run_kernel == (kind == "runs")
    assert set(at.tables) == set(ref.tables)
    if kind == "runs":
        assert all(np.array_equal(x, y) for x, y in zip(_run_tables(at, L), _run_tables(ref, L)))
    else:
        for name, value in ref.tables.items():
            if isinstance(value, torch.Tensor):
                a, b = at.tables[name].contiguous(), value.contiguous()
                assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), name


def test_a_per_layer_cache_builds_the_run_table_of_one_tensor_with_its_own_layer_bases(cupy_tables):
    """The cache's facts take each layer's base from its own tensor; runs, offsets and positions
    are those of the stacked cache."""
    L, H, D, N = 3, 2, 64, 16
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=16, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16)
    rope = RopeSpec(D, D, 1e6, True, MAXPOS, torch.bfloat16)
    kvs = [_segment(torch.bfloat16, t, torch.Generator().manual_seed(t), L, H, D) for t in (40, 33, 64)]
    slots = np.arange(5, 5 + 137, dtype=np.int64)
    old, new = np.arange(137, dtype=np.int64), np.arange(137, dtype=np.int64) + 12
    layers = [torch.zeros(layout.per_layer().physical_shape, dtype=torch.bfloat16) for _ in range(L)]
    stacked = layout.allocate(fill=0)
    got = _run_tables(PlacementPlan(layers, layout, rope=rope).prepare(kvs, slots, old_positions=old,
                                                                       new_positions=new), L)
    want = _run_tables(PlacementPlan(stacked, layout, rope=rope).prepare(kvs, slots, old_positions=old,
                                                                         new_positions=new), L)
    assert got is not None and want is not None
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert got[2].tolist() == [t.data_ptr() for t in layers]
    assert want[2].tolist() == [stacked.data_ptr() + i * layout.k_strides[0] * 2 for i in range(L)]


def test_the_one_call_placement_declines_off_the_gpu(fresh_facts):
    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, 16, 2, 64, dtype=torch.bfloat16)
    plan = PlacementPlan(layout.allocate(fill=0), layout)
    assert plan._single() is False
    assert plan._place_in_one_call([kv], [torch.arange(16)], None, None) is False


# ---------------------------------------------------------------------------------- on the GPU
def _flat_case(with_rope: bool, seed: int):
    L, H, D, N = 3, 2, 64, 16
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=40, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16)
    rope = RopeSpec(D, D, 1e6, True, MAXPOS, torch.bfloat16) if with_rope else None
    T = (40, 24, 57)
    gen = torch.Generator().manual_seed(seed)
    kvs = [_segment(torch.bfloat16, t, gen, L, H, D, "cuda") for t in T]
    slots = np.arange(30, 30 + sum(T), dtype=np.int64)
    old = np.random.default_rng(seed).integers(0, MAXPOS, sum(T)).astype(np.int64) if with_rope else None
    new = np.random.default_rng(seed + 1).integers(0, MAXPOS, sum(T)).astype(np.int64) if with_rope else None
    return layout, rope, T, kvs, slots, old, new


def _split(values, counts) -> list:
    return list(torch.split(torch.from_numpy(values), list(counts)))


def _torch_reference(layout, rope, T, kvs, slots, old, new, fill=0):
    ref = layout.allocate(fill=fill, device="cuda")
    kw = dict(rope=rope, old_positions=_split(old, T), new_positions=_split(new, T)) if rope is not None else {}
    place_many(kvs, ref, layout, _split(slots, T), backend="torch", **kw)
    torch.cuda.synchronize()
    return ref


@pytest.fixture
def launches(monkeypatch):
    """Every ``kmesh_gpu.cuda.launch`` (the ctypes launch) with whether the driver accepted it."""
    got = []
    real = cuda.launch

    def counted(*args):
        ok = real(*args)
        got.append(ok)
        return ok

    monkeypatch.setattr(cuda, "launch", counted)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("with_rope", [False, True], ids=["copy", "rope"])
def test_the_run_kernel_is_launched_by_one_compiled_driver_call_else_ctypes_else_cupy(monkeypatch, fresh_facts,
                                                                                     launches, with_rope):
    assert cuda.compiled_driver() is not None, "the GPU machine has libcuda and Numba"
    layout, rope, T, kvs, slots, old, new = _flat_case(with_rope, 3)
    kw = dict(old_positions=old, new_positions=new) if with_rope else {}
    ref = _torch_reference(layout, rope, T, kvs, slots, old, new)
    out = {}
    for variant in ("compiled", "ctypes", "cupy"):
        if variant == "ctypes":  # no compiled driver sequences here (Numba refused, say)
            monkeypatch.setattr(_facts, "_FACTS", {})
            monkeypatch.setattr(cuda, "compiled_driver", lambda: None)
        elif variant == "cupy":  # and the driver refuses the ctypes launch: CuPy's own call
            monkeypatch.setattr(cuda, "_DRIVER", [(None, None, None, None)])
        cache = layout.allocate(fill=0, device="cuda")
        launch = PlacementPlan(cache, layout, rope=rope, backend="cupy").prepare(kvs, slots, **kw)
        assert launch.uses_run_kernel
        launches.clear()
        launch.run()
        launch.run()  # a launch may run again: the same bits
        torch.cuda.synchronize()
        if variant == "compiled":
            assert launches == []  # the compiled call launched, not ctypes
        elif variant == "ctypes":
            assert launches == [True, True]
        else:
            assert launches == [False, False]
        out[variant] = cache.clone()
    for variant, got in out.items():
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), variant


@pytest.mark.gpu
def test_per_token_kernels_are_launched_by_ctypes_else_cupy_with_the_same_bits(monkeypatch, fresh_facts, launches):
    layout, rope, T, kvs, slots, old, new = _flat_case(True, 4)
    ref = _torch_reference(layout, rope, T, kvs, slots, old, new)
    for refused in (False, True):
        if refused:
            monkeypatch.setattr(cuda, "_DRIVER", [(None, None, None, None)])
        cache = layout.allocate(fill=0, device="cuda")
        plan = PlacementPlan(cache, layout, rope=rope, backend="cupy", shape=KernelShape(run_kernel=False))
        launches.clear()
        plan.place(kvs, slots, old_positions=old, new_positions=new)
        torch.cuda.synchronize()
        assert launches == [not refused]
        assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8)), refused


def small_ring(monkeypatch) -> list:
    """A 1 MiB table ring (fresh, for fresh cache facts): a table of 2048 tokens (~160 KiB) and the
    one-call region of as many tokens fit six at a time. Returns the list of its reservations
    (``None``: declined, the region it would lend still being read)."""
    from kmesh_gpu import _table_ring

    monkeypatch.setattr(_table_ring, "RING_BYTES", 1 << 20)
    monkeypatch.setattr(_table_ring, "_RINGS", {})
    monkeypatch.setattr(_facts, "_FACTS", {})
    got, real = [], _table_ring.TableRing.reserve

    def reserve(self, nbytes):
        region = real(self, nbytes)
        got.append(region)
        return region

    monkeypatch.setattr(_table_ring.TableRing, "reserve", reserve)
    return got


def _ring_case(seed: int):
    L, H, D, N, T = 2, 2, 128, 16, 2048
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=512, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=torch.float16)
    gen = torch.Generator().manual_seed(seed)
    kvs = [torch.randn(2, L, T, H, D, generator=gen).to(torch.float16).cuda() for _ in range(4)]
    slots = [torch.arange(i * T, (i + 1) * T, dtype=torch.int64) for i in range(4)]
    return layout, layout.allocate(fill=0, device="cuda"), kvs, slots


@pytest.mark.gpu
def test_many_prepared_placements_wrap_the_table_ring_and_stay_exact(monkeypatch):
    """More tables than the ring holds at once, each uploaded behind a slow kernel: the ring declines
    (the table goes up through torch) rather than overwrite a table still being copied, and every
    placement lands exactly."""
    reservations = small_ring(monkeypatch)
    layout, cache, kvs, slots = _ring_case(8)
    plan = PlacementPlan(cache, layout, backend="cupy")
    for _ in range(3):
        torch.cuda._sleep(int(20e6))  # ~10 ms: the uploads queued behind it stay pending
        for kv, s in zip(kvs, slots):
            launch = plan.prepare([kv], [s])
            assert launch.uses_run_kernel
            launch.run()
    torch.cuda.synchronize()
    assert None in reservations  # the ring ran out of free regions while the kernel spun ...
    assert any(r is not None for r in reservations)  # ... and lent them again once they were free
    expected = layout.allocate(fill=0, device="cuda")
    place_many(kvs, expected, layout, slots, backend="torch")
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.fixture
def one_calls(monkeypatch):
    """What each ``PlacementPlan.place`` did: True (one compiled call placed it) or False (the
    prepared path did), and the run counts ``_driver_jit.place_now`` returned."""
    from kmesh_gpu import _driver_jit

    took, returned = [], []
    real_call, real_now = PlacementPlan._place_in_one_call, _driver_jit.place_now

    def call(self, *args):
        ok = real_call(self, *args)
        took.append(ok)
        return ok

    def now(*args):
        R = real_now(*args)
        returned.append(int(R))
        return R

    monkeypatch.setattr(PlacementPlan, "_place_in_one_call", call)
    monkeypatch.setattr(_driver_jit, "place_now", now)
    return took, returned


@pytest.mark.gpu
@pytest.mark.parametrize("with_rope", [False, True], ids=["copy", "rope"])
@pytest.mark.parametrize("form", ["lists", "flat", "staged"])
def test_place_is_one_compiled_call_and_places_what_torch_places(fresh_facts, one_calls, with_rope, form):
    took, returned = one_calls
    layout, rope, T, kvs, slots, old, new = _flat_case(with_rope, 11)
    if form == "lists":
        segments, idx = kvs, lambda a: _split(a, T)
    elif form == "flat":
        segments, idx = kvs, lambda a: a
    else:  # the items back to back in one staging buffer, as a restore stages them
        staging = torch.cat([kv.reshape(-1).view(torch.uint8) for kv in kvs])
        sizes = [kv.numel() * 2 for kv in kvs]
        segments = StagedSegments(staging, tuple(sum(sizes[:i]) for i in range(3)), T, torch.bfloat16)
        idx = lambda a: a  # noqa: E731
    kw = dict(old_positions=idx(old), new_positions=idx(new)) if with_rope else {}
    cache = layout.allocate(fill=0x2A, device="cuda")
    plan = PlacementPlan(cache, layout, rope=rope, backend="cupy")
    for _ in range(2):  # again: the one call's constants are reused from the cache's facts
        plan.place(segments, idx(slots), **kw)
    torch.cuda.synchronize()
    assert took == [True, True] and len(returned) == 2 and all(r > 0 for r in returned)
    expected = _torch_reference(layout, rope, T, kvs, slots, old, new, fill=0x2A)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
def test_one_call_placements_behind_a_slow_kernel_never_overwrite_a_table_in_use(monkeypatch, one_calls):
    """More one-call placements than the ring holds at once, queued behind a spinning kernel: a
    region (and its device mirror, which the kernel reads) is not handed out again before the
    kernel that reads it has run, so the one call declines (the prepared path places) and every
    placement lands."""
    took, _ = one_calls
    reservations = small_ring(monkeypatch)
    layout, cache, kvs, slots = _ring_case(9)
    plan = PlacementPlan(cache, layout, backend="cupy")
    for _ in range(3):
        torch.cuda._sleep(int(20e6))  # ~10 ms: the kernels queued behind it stay pending
        for kv, s in zip(kvs, slots):
            plan.place([kv], [s])
    torch.cuda.synchronize()
    assert True in took and False in took  # one calls placed, and the ring ran out while the kernel spun
    assert None in reservations
    expected = layout.allocate(fill=0, device="cuda")
    place_many(kvs, expected, layout, slots, backend="torch")
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["not increasing", "skipped token", "duplicate slot", "int32 slots",
                                  "unaligned item", "position out of range", "shape", "runs too short"])
def test_the_one_call_covers_or_declines_and_the_placement_is_exact_or_refused(fresh_facts, one_calls, case):
    """Unsorted slots and skipped tokens are placed by the one call; a source off a 16-byte
    boundary or slots a run per token go to the per-token kernel; bad input is refused by name
    with nothing written, whichever path saw it first."""
    took, returned = one_calls
    layout, rope, T, kvs, slots, old, new = _flat_case(True, 12)
    slots = slots.copy()
    segments = list(kvs)
    if case == "not increasing":
        slots[[3, 4]] = slots[[4, 3]]
    elif case == "skipped token":
        slots[45] = -1
    elif case == "duplicate slot":
        slots[70] = slots[2]
    elif case == "int32 slots":
        slots = slots.astype(np.int32)
    elif case == "unaligned item":
        flat = torch.empty(kvs[1].numel() + 1, dtype=torch.bfloat16, device="cuda")
        segments[1] = flat[1:].view(kvs[1].shape).copy_(kvs[1])  # 2 bytes off a 16-byte boundary
    elif case == "position out of range":
        new = new.copy()
        new[7] = MAXPOS
    elif case == "shape":
        segments[1] = torch.zeros((2, layout.num_layers + 1) + tuple(kvs[1].shape[2:]), dtype=torch.bfloat16,
                                  device="cuda")
    else:
        slots = np.arange(0, 2 * sum(T), 2, dtype=np.int64)
    cache = layout.allocate(fill=0, device="cuda")
    plan = PlacementPlan(cache, layout, rope=rope, backend="cupy")
    refused = case in ("duplicate slot", "int32 slots", "position out of range", "shape")
    if refused:
        with pytest.raises(LayoutError):
            plan.place(segments, slots, old_positions=old, new_positions=new)
        torch.cuda.synchronize()
        assert not cache.view(torch.uint8).any()  # nothing was placed
        assert took == [False]
        return
    plan.place(segments, slots, old_positions=old, new_positions=new)
    torch.cuda.synchronize()
    assert took == [case in ("not increasing", "skipped token")], took
    expected = _torch_reference(layout, rope, T, kvs, slots, old, new)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["NHD", "HND"])
def test_a_per_layer_cache_takes_the_run_kernel_and_the_one_call(fresh_facts, one_calls, name):
    took, _ = one_calls
    L, H, D, N = 3, 2, 64, 16
    layout = KVLayout.from_vllm(name, num_layers=L, num_blocks=16, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16)
    rope = RopeSpec(D, D, 1e6, True, MAXPOS, torch.bfloat16)
    kvs = [_segment(torch.bfloat16, t, torch.Generator().manual_seed(t), L, H, D, "cuda") for t in (40, 33, 64)]
    slots = torch.arange(5, 5 + 137)
    old, new = torch.arange(137), torch.arange(137) + 12
    layers = [torch.full(layout.per_layer().physical_shape, 0.25, dtype=torch.bfloat16, device="cuda")
              for _ in range(L)]
    ref = [x.clone() for x in layers]
    plan = PlacementPlan(layers, layout, rope=rope, backend="cupy")
    assert plan.prepare(kvs, slots, old_positions=old, new_positions=new).uses_run_kernel
    plan.place(kvs, slots, old_positions=old, new_positions=new)
    assert took == [True]
    place_many(kvs, [ref] * 3, layout, list(torch.split(slots, [40, 33, 64])), rope=rope,
               old_positions=list(torch.split(old, [40, 33, 64])), new_positions=list(torch.split(new, [40, 33, 64])),
               backend="torch")
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(layers, ref))
