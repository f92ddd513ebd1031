"""kmesh_gpu._table_ring.TableRing: regions are lent in order and lent again only once the event
recorded after their copy has completed; the ring declines rather than waits."""

from __future__ import annotations

import threading

import pytest

from kmesh_gpu._table_ring import TableRing


class FakeEvent:
    def __init__(self, name: int):
        self.name, self.complete = name, False

    def query(self) -> bool:
        return self.complete


def _ring(nbytes: int = 4096):
    made: list = []

    def new_event():
        made.append(FakeEvent(len(made)))
        return made[-1]

    return TableRing(nbytes, pin=False, new_event=new_event), made


def test_regions_are_lent_in_order_aligned_and_disjoint():
    ring, made = _ring()
    got = [ring.reserve(n) for n in (10, 256, 300)]
    assert [g[0] for g in got] == [0, 256, 512]  # 256-byte aligned, one after another
    assert len({id(g[1]) for g in got}) == 3 and ring.pending() == 3
    assert ring.t64.numel() * 8 == ring.size and ring.a64.shape == (ring.size // 8,)


def test_a_region_still_being_read_is_not_lent_again():
    ring, made = _ring(4096)
    first = ring.reserve(1024)  # quarter of the ring: the largest a ring lends
    for _ in range(3):
        assert ring.reserve(1024) is not None
    assert ring.reserve(1024) is None  # the next one would overlap the first, whose copy is pending
    first[1].complete = True
    again = ring.reserve(1024)
    assert again is not None and again[0] == first[0] and again[1] is first[1]  # wrapped; event reused
    assert ring.reserve(1025) is None  # over a quarter of the ring: declined whatever is free


def test_the_tail_is_skipped_when_a_region_does_not_fit_before_the_end():
    ring, made = _ring(4096)
    a = ring.reserve(1024)
    b = ring.reserve(1024)
    c = ring.reserve(768)
    assert (a[0], b[0], c[0]) == (0, 1024, 2048)
    a[1].complete = True
    assert ring.reserve(1024)[0] == 2816  # still fits before the end
    assert ring.reserve(1024)[0] == 0  # past the end: wrapped to the start, a's region (free)
    assert ring.reserve(1024) is None  # b's region next, still pending


def test_cancel_returns_a_region_whose_copy_was_never_queued():
    ring, _ = _ring(4096)
    regions = [ring.reserve(1024) for _ in range(4)]
    assert ring.reserve(1024) is None
    ring.cancel(regions[0][0])
    assert ring.reserve(1024)[0] == 0 and ring.pending() == 4


def test_no_event_means_no_region():
    ring = TableRing(4096, pin=False, new_event=lambda: None)
    assert ring.reserve(64) is None and ring.pending() == 0
    assert ring.reserve(64) is None


def test_concurrent_borrowers_get_disjoint_regions():
    ring, made = _ring(1 << 16)
    got, lock = [], threading.Lock()

    def borrow():
        for _ in range(8):
            r = ring.reserve(512)
            if r is not None:
                with lock:
                    got.append(r[0])

    threads = [threading.Thread(target=borrow) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(got) == len(set(got)) == 64  # 8 threads x 8 regions of 512 bytes: half the ring


@pytest.mark.gpu
def test_ring_events_fence_a_real_copy():
    import torch

    from kmesh_gpu import cuda

    stream = torch.cuda.Stream()
    ring = TableRing(1 << 16, pin=True, new_event=cuda.DriverEvent.create)
    dst = torch.empty(1 << 14, dtype=torch.uint8, device="cuda")
    regions = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(20e6))
        for _ in range(4):
            offset, event = ring.reserve(1 << 14)
            assert cuda.copy_htod(dst.data_ptr(), ring.base + offset, 1 << 14, stream.cuda_stream)
            assert event.record(stream.cuda_stream)
            regions.append(offset)
    assert ring.reserve(1 << 14) is None  # every region's copy waits behind the spin kernel
    stream.synchronize()
    assert ring.reserve(1 << 14)[0] == regions[0]


def test_a_lent_region_never_overlaps_one_still_being_read():
    """Many laps of random sizes and completion orders: every region handed out is disjoint from
    every region whose event has not completed, and the ring keeps lending as regions complete."""
    import random

    rng = random.Random(3)
    ring, made = _ring(1 << 14)
    live = []  # (start, end, event) not yet complete
    lent = 0
    for _ in range(3000):
        if live and rng.random() < 0.45:  # some copy completes, not necessarily the oldest
            i = rng.randrange(len(live)) if rng.random() < 0.3 else 0
            live.pop(i)[2].complete = True
        n = rng.choice([64, 200, 700, 1500, 4096])
        got = ring.reserve(n)
        if got is None:
            continue
        start, event = got
        event.complete = False  # the borrower records it after its copy (a reused event too)
        end = start + n
        assert start % 256 == 0 and end <= ring.size
        assert all(not (s < end and start < e) for s, e, _ in live)
        live.append((start, end, event))
        lent += 1
    assert lent > 1000  # it kept lending
