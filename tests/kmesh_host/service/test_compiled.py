"""The service's compiled hot-path passes (kmesh_host.service._compiled) against the NumPy paths
they stand in for: the restore check never accepts what Registry.block_ids_of_slots (plus the
position check) rejects, gives the same blocks, and accepts every usual request; reserve and
release change exactly what the NumPy semantics change; bad arguments give codes, not accesses."""

from __future__ import annotations

import numpy as np

from kmesh_gpu.errors import LayoutError
from kmesh_host.service import _compiled
from kmesh_host.service.registry import Registry


class _Reg:
    reg_id = 1

    def __init__(self, blocks: int, block_size: int):
        self.num_slots, self.block_size = blocks * block_size, block_size


def _items(rng, reg, n):
    items = []
    for _ in range(n):
        cnt = int(rng.integers(0, 6))
        mode = int(rng.integers(0, 4))
        if mode == 0:  # a run, possibly out of range at either end
            start = int(rng.integers(-2, reg.num_slots + 2))
            items.append(np.arange(start, start + cnt))
        elif mode == 1:  # anything
            items.append(rng.integers(-2, reg.num_slots + 2, size=cnt))
        elif mode == 2:  # sorted distinct
            items.append(np.sort(rng.choice(reg.num_slots, size=min(cnt, reg.num_slots), replace=False)))
        else:  # sorted, maybe repeated, maybe -1
            items.append(np.sort(rng.integers(-1, reg.num_slots, size=cnt)))
    return [x.astype(np.int64) for x in items]


def test_restore_check_matches_numpy(compiled):
    rng = np.random.default_rng(1)
    accepted = unusual = 0
    for _ in range(6000):
        reg = _Reg(int(rng.integers(1, 12)), int(rng.choice([1, 2, 4, 16])))
        items = _items(rng, reg, int(rng.integers(1, 5)))
        slots = np.concatenate(items)
        P = int(rng.integers(0, 6))
        pos = rng.integers(-1, P + 1, size=int(rng.integers(0, 4)) if P else 0).astype(np.int64)
        values = np.concatenate([slots, pos])
        starts = np.cumsum([0, *[len(x) for x in items]], dtype=np.int64)
        out = np.empty(len(slots), dtype=np.int64)
        got = compiled.restore_blocks(values, starts, np.array([reg.num_slots, reg.block_size, P], dtype=np.int64),
                                      out)
        pos_ok = bool(((pos >= 0) & (pos < P)).all())
        try:
            ref = Registry.block_ids_of_slots(reg, slots).tolist()
        except LayoutError:
            ref = None
        if got >= 0:
            accepted += 1
            assert pos_ok and ref is not None and (slots >= 0).all() and out[:got].tolist() == ref
        else:
            assert got == _compiled.UNUSUAL
            unusual += 1
            if pos_ok and ref is not None and (slots >= 0).all():  # a usual request must not be left out
                nonempty = sorted([x for x in items if len(x)], key=lambda x: x[0])
                increasing = all((np.diff(x) > 0).all() for x in nonempty)
                apart = all(a[-1] < b[0] for a, b in zip(nonempty, nonempty[1:]))
                assert not (increasing and apart)
    assert accepted > 500 and unusual > 500


def test_restore_check_inconsistent_arguments_give_a_code(compiled):
    params = np.array([16, 4, 10], dtype=np.int64)
    values = np.arange(6, dtype=np.int64)
    out = np.empty(6, dtype=np.int64)
    for starts in ([1, 3], [0, 9], [0, 4, 2], [0, 3, 7]):  # not from 0, past the body, decreasing, past the end
        assert compiled.restore_blocks(values, np.array(starts, dtype=np.int64), params, out) == _compiled.UNUSUAL
    assert compiled.restore_blocks(values, np.array([0, 6], dtype=np.int64), params, out[:2]) == _compiled.UNUSUAL
    assert compiled.restore_blocks(values, np.array([0, 6], dtype=np.int64),
                                   np.array([16, 0, 10], dtype=np.int64), out) == _compiled.UNUSUAL


def test_reserve_and_release_match_numpy(compiled):
    rng = np.random.default_rng(2)
    for _ in range(4000):
        nb = int(rng.integers(1, 10))
        holders = rng.choice([0, 0, 0, 5], size=nb).astype(np.int64)
        blocks = np.unique(rng.integers(0, nb, size=int(rng.integers(0, nb + 1)))).astype(np.int64)
        before = holders.copy()
        code = compiled.reserve(holders, blocks, 9)
        if np.count_nonzero(before[blocks]):  # some block held: nothing changes, the first held one named
            assert code >= 0 and before[blocks[code]] != 0 and (before[blocks[:code]] == 0).all()
            assert (holders == before).all()
        else:
            before[blocks] = 9
            assert code == _compiled.RESERVED and (holders == before).all()
            assert compiled.release(holders, blocks, 9) == 0 and not (holders == 9).any()
    held = np.zeros(4, dtype=np.int64)
    assert compiled.reserve(held, np.array([0, 99], dtype=np.int64), 1) == _compiled.OUT_OF_RANGE
    assert compiled.reserve(held, np.array([-1], dtype=np.int64), 1) == _compiled.OUT_OF_RANGE
    assert not held.any()
    held[2] = 7  # release frees only what the op holds, and counts the rest
    assert compiled.release(held, np.array([1, 2, 50], dtype=np.int64), 3) == 3 and held[2] == 7
