"""Which path of :mod:`kmesh_host.service.restores` served a restore (the status counters, the
client's routes): the usual request is one prepare of the registration's placement plan from the
body's arrays as they are, a request mixing shifted and plain items two; on a GPU, a channel's
restore is served by its compiled loop instead. Every path lands what the reference places."""

from __future__ import annotations


import pytest
import torch

from kmesh_gpu import place_many
from kmesh_host.service import CacheClient, SharedCache
from tests.kmesh_host.service.helpers import (fingerprint, fingerprint_of, put_original, running_service, small_layout,
                                              small_rope)

POISON = 0x5A


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.05) as svc:
        yield svc


def _bits(t):
    return t.view(torch.uint8).cpu().clone()


@pytest.mark.parametrize("kinds", ["shifted", "plain", "mixed"])
def test_one_prepare_unless_shifted_and_plain_items_mix(service, kinds):
    layout, rope = small_layout(), small_rope()
    g = torch.Generator().manual_seed(4)
    kvs = [torch.randn(2, 2, 4, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
    news = {"shifted": ([10, 11, 12, 13], [40, 41, 42, 43]), "plain": (None, None),
            "mixed": ([10, 11, 12, 13], None)}[kinds]
    with SharedCache(layout, fill=POISON) as cache, CacheClient(service.socket_path, timeout=60) as client:
        keys = [put_original(client, kv) for kv in kvs]
        reg = client.register(cache, layout, model_fingerprint=fingerprint(), rope=rope)
        before = client.status()["counters"]
        client.restore(reg, [(k, s, p) if p is not None else (k, s)
                             for k, s, p in zip(keys, ([0, 1, 2, 3], [8, 9, 10, 11]), news)])
        after = client.status()["counters"]
        one, two = (after[c] - before[c] for c in ("placements_one_prepare", "placements_two_prepares"))
        assert (one, two) == ((0, 1) if kinds == "mixed" else (1, 0))
        assert client.route_counts == {"channel": 0, "socket": 1} and client.last_route == "socket"
        ref = layout.allocate(fill=POISON)
        for kv, s, p in zip(kvs, ([0, 1, 2, 3], [8, 9, 10, 11]), news):
            kw = {} if p is None else dict(rope=rope, old_positions=[torch.arange(4)], new_positions=[torch.tensor(p)])
            place_many([kv], ref, layout, [torch.tensor(s)], **kw)
        assert torch.equal(_bits(cache.tensor), _bits(ref))
        assert client.close_registration(reg) is True


@pytest.mark.gpu
@pytest.mark.parametrize("channel", [False, True], ids=["socket", "channel"])
@pytest.mark.parametrize("shift", [True, False], ids=["rope", "copy"])
def test_the_usual_restore_is_prepared_from_the_request_body_as_it_is(service, shift, channel):
    """Through the socket: a CUDA restore whose items all shift (or none does) is prepared from the
    request's index arrays as they are (one prepare of the registration's plan, the status counts
    it); through a channel the same restore is served by the channel's compiled loop (the client
    counts it). Both land exactly as the torch reference."""
    with CacheClient(service.socket_path, timeout=120, channel=channel) as client:
        _usual_restore(client, shift, channel)


def _usual_restore(client, shift: bool, channel: bool):
    """The restore of the test above, through ``client``."""
    from kmesh_gpu import KVLayout, RopeSpec

    layout = KVLayout.from_vllm("NHD", num_layers=3, num_blocks=24, block_size=16, num_kv_heads=2, head_size=64,
                                dtype=torch.bfloat16)
    rope = RopeSpec(64, 64, 1e6, True, 4096, torch.bfloat16)
    cache = layout.allocate("cuda", fill=POISON)
    reg = client.register(cache, layout, model_fingerprint=fingerprint_of(layout), rope=rope)
    g = torch.Generator().manual_seed(21)
    items, kvs, olds, slots, news = [], [], [], [], []
    start = 20
    for i, T in enumerate((40, 33, 64)):
        kv = torch.randn(2, 3, T, 2, 64, generator=g).to(torch.bfloat16)
        old = torch.arange(100 * i, 100 * i + T, dtype=torch.int64)
        key = put_original(client, kv, old, fp=fingerprint_of(layout))
        s = torch.arange(start, start + T, dtype=torch.int64)
        new = torch.randint(0, 4096, (T,), generator=g)
        start += T + 5
        items.append((key, s, new) if shift else (key, s))
        kvs.append(kv.cuda())
        olds.append(old)
        slots.append(s)
        news.append(new)
    torch.cuda.synchronize()
    before = client.status()["counters"]
    try:
        client.restore(reg, items)
        after = client.status()["counters"]
        assert after["placements_two_prepares"] == before["placements_two_prepares"]
        if channel:
            assert client.route_counts == {"channel": 1, "socket": 0} and client.last_route == "channel"
            assert after["placements_one_prepare"] == before["placements_one_prepare"]
        else:
            assert after["placements_one_prepare"] == before["placements_one_prepare"] + 1
        ref = layout.allocate("cuda", fill=POISON)
        kw = dict(rope=rope, old_positions=olds, new_positions=news) if shift else {}
        place_many(kvs, ref, layout, slots, backend="torch", **kw)
        torch.cuda.synchronize()
        assert torch.equal(_bits(cache), _bits(ref))
    finally:
        assert client.close_registration(reg, timeout=60) is True
        for key, *_ in items:
            client.evict(key)
