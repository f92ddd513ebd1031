"""Restore of the seed-size child through the cache service vs in-process, and 16 concurrent clients.

What each timed path includes (the same work on both sides, so the ratio is the service's own cost):

* in-process: the local cache's ``kmesh_gpu.PlacementPlan`` (``prepare`` then ``Launch.run``, with
  the RoPE shift) from originals already resident on the restoring device, then a
  synchronisation. On CUDA the originals are uploaded once before timing, because the service keeps device copies of the originals it has restored from
  (``ServiceConfig.device_budget_bytes``) and has made them during the warm-up.
* service: ``ServiceRestorer.restore`` (the restore contract over a ``CacheClient``): the client
  request (binary index arrays; the client's re-recorded interprocess event when its stream has
  work queued), the socket round trip, authorisation, bounds checks and block reservation, one
  prepare of the registration's placement plan from the service's device copies into the
  registered cache (CUDA IPC or shared memory), waiting for the copy's completion event,
  releasing the holds and the reply.

Index inputs (``--inputs``), the same for both paths, so that neither pays a conversion the other
does not: ``tensors`` (default; what a model runner holds: the child's slot and new-position
int64 CPU tensors, built once before timing) go to the plan's ``prepare`` as they are and to
``ServiceRestorer.restore`` as they are (the client sends their memory without converting it).
``lists`` (Python lists of ints): each path converts every list inside its timed region with the
same call, ``numpy.asarray(values, dtype=int64)`` viewed as a tensor with ``torch.from_numpy``
(the restore contract's items are int64 tensors). Both convert the same 8 lists.

Seed-size child (seed §24): 4 shared segments of 104 tokens, 24 layers, 2 KV heads, head size 64,
bf16, placed with a RoPE shift into a 512-token prompt's paged cache (NHD, block size 16).

* Paired comparison: the same restore in-process (resident originals -> the plan's prepare and run)
  and through the service (request -> the service does the same into the registered cache ->
  reply after the copy's event completed), alternating which goes first, ``--pairs`` pairs (21 by
  default). Reports medians per path, the median and quartiles of the paired ratios (target
  <= 1.15) and checks that both paths give identical bits. On a GPU without MPS a restore right
  after the other path's pays a switch between the two processes' contexts and one right after
  its own path's does not, so per-pair ratios fall into two groups (each pair holds one restore
  of each kind) and their median lands in whichever group has more pairs; the median over
  balanced blocks (two consecutive pairs: each path once of each kind) is reported beside it.
* Back to back (``--back-to-back``, 41 by default): each path run that many times in a row, for the
  steady state of a worker using one path only (see :func:`back_to_back`): the alternating pairs
  make both paths pay for the GPU switching between the two processes' CUDA contexts (no MPS on
  the machine), a worker restoring only through one path pays it on the service path only.
* Concurrency: ``--clients`` processes (16) each register their own cache, restore the child once
  (the per-registration first restore, reported apart) and then ``--rounds`` times from a common
  start line; reports the steady-state throughput (restores over the window from the first client's
  start to the last one's end), latency, errors, and the service's device memory and open IPC
  mappings before and after (they must return to the baseline).

* Channel (CUDA; ``--no-channel`` skips it): the same paired comparison, a back-to-back row and the
  16 clients again with ``CacheClient(channel=True)``, whose restores go through a polled page of
  shared memory to a compiled loop in the service (``kmesh_host.service.channel``); the report says
  how many each route served. Back to back, the in-process restore is also timed through the one
  compiled call of ``PlacementPlan.place`` (prepare and run in one compiled call on CUDA): a channel
  runs the same compiled preparation, so the channel against it shows what the service itself adds.

* Stage breakdown (``--timing-runs``, 21 by default, after the paired runs so they do not perturb
  them): further service restores with ``timings=True``; prints the median time between
  consecutive stages (client: start, built, sent, received; service: received, parsed, validated,
  resolved, prepared, launched, completed, reply_sent; one monotonic clock for both processes).
  ``client.sent`` is stamped once ``sendmsg`` has returned, so the service may have stamped
  ``received`` before it: single rows of ``sent -> service.received`` can be negative.

* Polling: by default client and service poll their sockets briefly before sleeping in ``recv``
  where the machine has cores to spare (``CacheClient(reply_spin_s=)``,
  ``ServiceConfig.receive_spin_s``); ``--reply-spin-s`` / ``--receive-spin-s`` set them (0: off),
  for comparisons. The values used are in the report.

Usage: ``python perf/bench_service.py [--device cpu|cuda] [--out perf/out/]``. Prints a table and
writes ``bench_service_<device>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kmesh_gpu import KVLayout, PlacementPlan, RopeSpec  # noqa: E402
from kmesh_host import ModelFingerprint  # noqa: E402
from kmesh_host.restore import RestoreItem, ServiceRestorer  # noqa: E402
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache  # noqa: E402
from kmesh_host.service import protocol  # noqa: E402

LAYERS, HEADS, HEAD, SEGMENTS, SEG_TOKENS, PROMPT, BLOCK = 24, 2, 64, 4, 104, 512, 16


@dataclasses.dataclass(frozen=True)
class Shape:
    """A child's model shape: the seed's (the target's) and larger models' KV per token, with the
    seed's token structure (4 segments of 104 tokens in a 512-token prompt)."""
    name: str
    layers: int
    heads: int
    head: int

    @property
    def child_bytes(self) -> int:  # K and V of every segment token, bf16
        return 2 * self.layers * SEGMENTS * SEG_TOKENS * self.heads * self.head * 2


SEED = Shape("seed", LAYERS, HEADS, HEAD)
#: larger children of the same token structure, for the service's overhead against the restore's size
#: (KV per token: seed 12 KiB; Qwen2.5-7B-like 56 KiB; Llama-70B-like 320 KiB)
SHAPES = {"seed": SEED, "7b": Shape("7b", 28, 4, 128), "70b": Shape("70b", 80, 8, 128)}


def child_layout(shape: Shape = SEED) -> KVLayout:
    return KVLayout.from_vllm("NHD", num_layers=shape.layers, num_blocks=PROMPT // BLOCK, block_size=BLOCK,
                              num_kv_heads=shape.heads, head_size=shape.head, dtype=torch.bfloat16)


def child_rope(shape: Shape = SEED) -> RopeSpec:
    return RopeSpec(shape.head, shape.head, 1e6, True, 32768, torch.bfloat16)


def child_fingerprint(shape: Shape = SEED) -> ModelFingerprint:
    return ModelFingerprint("BenchForCausalLM", shape.layers, shape.heads, shape.head, "bfloat16",
                            child_rope(shape).to_dict())


def originals(seed: int = 0, shape: Shape = SEED):
    """Four segments as the leader saved them: ``(token ids, kv, positions)``, keys post-RoPE at the
    leader's positions."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(SEGMENTS):
        kv = torch.randn(2, shape.layers, SEG_TOKENS, shape.heads, shape.head, generator=g).to(torch.bfloat16)
        pos = torch.arange(i * SEG_TOKENS, (i + 1) * SEG_TOKENS, dtype=torch.int64)
        out.append((pos + 1000, kv, pos))
    return out


def put_originals(client, shape: Shape = SEED) -> list[str]:
    """The four segments published through ``client``: their keys."""
    fp = child_fingerprint(shape)
    return [client.put(kv, tok, pos, model_fingerprint=fp) for tok, kv, pos in originals(shape=shape)]


def child_plan(keys, shape: Shape = SEED):
    """Where the child puts each segment (``keys``: the service's): after a 16-token preamble, 8
    tokens of other text between."""
    plan, p = [], 16
    for i in range(SEGMENTS):
        pos = list(range(p, p + SEG_TOKENS))
        plan.append((keys[i], pos, pos))  # slots = positions in a fresh 512-token prompt
        p += SEG_TOKENS + 8
    return plan


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def index_inputs(plan, kind: str):
    """The child's plan with its slots and new positions as the paths are given them: int64 CPU
    tensors (``"tensors"``, made here, once) or the Python lists (``"lists"``)."""
    if kind == "lists":
        return plan
    return [(k, torch.tensor(s, dtype=torch.int64), torch.tensor(p, dtype=torch.int64)) for k, s, p in plan]


def as_index_tensor(values) -> torch.Tensor:
    """What both paths do with one index input: a tensor is used as it is; a list is converted
    (``numpy.asarray(..., int64)``, viewed as a tensor)."""
    if isinstance(values, torch.Tensor):
        return values
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def child_setup(device: str, keys, inputs: str = "tensors", shape: Shape = SEED) -> tuple:
    """``(layout, rope, plan, resident)``: the child's cache layout and RoPE spec, its plan over
    ``keys`` with the index inputs of ``inputs`` (:func:`index_inputs`), and the originals already
    on ``device`` (as the in-process path restores them)."""
    resident = [(k, kv.to(device), p) for k, (_, kv, p) in zip(keys, originals(shape=shape))]
    return child_layout(shape), child_rope(shape), index_inputs(child_plan(keys, shape), inputs), resident


def _inputs(resident_originals, plan):
    kvs, slots, old, new = [], [], [], []
    for (key, kv, pos), (_, slot, newpos) in zip(resident_originals, plan):
        kvs.append(kv)
        slots.append(as_index_tensor(slot))
        old.append(pos)
        new.append(as_index_tensor(newpos))
    return kvs, slots, old, new


def in_process_restore(placement: PlacementPlan, resident_originals, plan, device: str) -> None:
    """``placement``: the local cache's plan (with the RoPE spec); ``resident_originals``: ``(key, kv,
    positions)`` with ``kv`` already on ``device``; ``plan``: ``(key, slots, new_positions)`` from
    :func:`index_inputs`. Prepared and run in two steps (the validation and tables, then the launch)."""
    kvs, slots, old, new = _inputs(resident_originals, plan)
    placement.prepare(kvs, slots, old_positions=old, new_positions=new).run()
    sync(device)


def in_process_compiled(placement: PlacementPlan, resident_originals, plan, device: str) -> None:
    """The same restore in-process through ``PlacementPlan.place`` (on CUDA one compiled call:
    indices gathered, checked, tabulated, uploaded and the run kernel launched), then a
    synchronisation: the fastest in-process path, what a channel's compiled request path is compared
    with besides the two-step one."""
    kvs, slots, old, new = _inputs(resident_originals, plan)
    placement.place(kvs, slots, old_positions=old, new_positions=new)
    sync(device)


def service_items(plan) -> list[RestoreItem]:
    """The restore contract's items of ``plan`` (a list input converted as the in-process path does)."""
    return [RestoreItem(k, as_index_tensor(s), as_index_tensor(p)) for k, s, p in plan]


def _alloc(layout, device, per_layer: bool = False):
    """``(shared memory to close or None, what is registered, the cache as the service writes it)``;
    ``per_layer``: one allocation per layer, as vLLM makes them (lists)."""
    if per_layer:
        view = layout.per_layer()
        if device == "cpu":
            shared = [SharedCache(view, fill=0) for _ in range(layout.num_layers)]
            return shared, shared, [x.tensor for x in shared]
        layers = [torch.zeros(view.physical_shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        return None, layers, layers
    if device == "cpu":
        shared = SharedCache(layout, fill=0)
        return shared, shared, shared.tensor
    t = layout.allocate(device, fill=0)
    return None, t, t


def _local(layout, device, per_layer: bool):
    if not per_layer:
        return layout.allocate(device, fill=0)
    view = layout.per_layer()
    return [torch.zeros(view.physical_shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]


def _bytes(cache) -> torch.Tensor:
    parts = [cache] if isinstance(cache, torch.Tensor) else cache
    return torch.cat([x.reshape(-1).view(torch.uint8).cpu() for x in parts])


def _close(shared) -> None:
    for x in shared if isinstance(shared, list) else [shared] if shared is not None else []:
        x.close()


def _client_proc(socket_path: str, device: str, rounds: int, reply_spin_s, inputs: str, keys, barrier, out,
                 channel: bool = False) -> None:
    errors, times, first, start, end, counts = [], [], None, None, None, None
    try:
        layout, plan = child_layout(), index_inputs(child_plan(keys), inputs)
        shared, registrable, _ = _alloc(layout, device)
        with CacheClient(socket_path, timeout=300, reply_spin_s=reply_spin_s, channel=channel) as c:
            restorer = ServiceRestorer(c, registrable, layout, model_fingerprint=child_fingerprint(),
                                       rope=child_rope())
            # one restore before the start line: the first opens this client's interprocess event
            # in the service and maps its cache there, costs a worker pays once per registration
            t0 = time.perf_counter()
            try:
                restorer.restore(service_items(plan))
            except Exception as exc:
                errors.append(f"first restore: {type(exc).__name__}: {exc}")
            first = time.perf_counter() - t0
            barrier.wait(timeout=300)
            start = time.monotonic()  # one clock for every process on Linux
            for _ in range(rounds):
                t0 = time.perf_counter()
                try:
                    restorer.restore(service_items(plan))
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                times.append(time.perf_counter() - t0)
            end = time.monotonic()
            counts = dict(c.route_counts)
            try:
                restorer.close()
            except Exception as exc:
                errors.append(f"close: {type(exc).__name__}: {exc}")
        if shared is not None:
            registrable = None
            shared.close()
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    out.put({"pid": os.getpid(), "errors": errors, "times": times, "first_s": first, "start": start, "end": end,
             "route_counts": counts})


def paired(args, client, socket_path, keys, shape: Shape = SEED, pairs: int | None = None,
           timing_runs: int | None = None, per_layer: bool = False) -> dict:
    """``per_layer``: both paths restore into one allocation per layer (the service's registration
    is of those allocations), as vLLM allocates its caches."""
    device = args.device
    pairs = args.pairs if pairs is None else pairs
    timing_runs = args.timing_runs if timing_runs is None else timing_runs
    layout, rope, plan, resident = child_setup(device, keys, args.inputs, shape)  # uploaded once, like the service's
    sync(device)
    shared, registrable, svc_cache = _alloc(layout, device, per_layer)
    local = _local(layout, device, per_layer)
    placement = PlacementPlan(local, layout, rope=rope)
    restorer = ServiceRestorer(client, registrable, layout, model_fingerprint=child_fingerprint(shape), rope=rope)

    def run_local():
        t0 = time.perf_counter()
        in_process_restore(placement, resident, plan, device)
        return time.perf_counter() - t0

    def run_service():
        t0 = time.perf_counter()
        restorer.restore(service_items(plan))
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        run_local()
        run_service()
    identical = torch.equal(_bytes(local), _bytes(svc_cache))
    loc, svc = [], []
    for i in range(pairs):  # alternating which path goes first
        if i % 2 == 0:
            loc.append(run_local())
            svc.append(run_service())
        else:
            svc.append(run_service())
            loc.append(run_local())
    stages = None
    if timing_runs > 0:
        rows = []
        for _ in range(timing_runs):  # (the client's own call: the contract has no timings)
            client.restore(restorer.registration, [(k, s, p) for k, s, p in plan], timings=True)
            rows.append(client.last_timings)
        stages = stage_medians(rows)
    restorer.close()
    svc_cache = registrable = restorer = None
    _close(shared)
    ratios = sorted(b / a for a, b in zip(loc, svc))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    # Balanced blocks: pairs 2k and 2k + 1 run in-process, service, service, in-process, so each
    # path runs once right after the other path (paying the switch of the GPU between the two
    # processes' contexts) and once right after itself. A single pair holds one of each kind, and
    # its ratio swings between the two (bimodal per-pair ratios); a block's ratio does not.
    blocks = sorted((svc[i] + svc[i + 1]) / (loc[i] + loc[i + 1]) for i in range(0, len(loc) - 1, 2))
    bq = statistics.quantiles(blocks, n=4) if len(blocks) >= 2 else blocks * 3 if blocks else [None] * 3
    return {"in_process_ms": [x * 1e3 for x in loc], "service_ms": [x * 1e3 for x in svc],
            "in_process_median_ms": statistics.median(loc) * 1e3, "service_median_ms": statistics.median(svc) * 1e3,
            "median_paired_ratio": statistics.median(ratios), "paired_ratio_quartiles": [q[0], q[2]],
            "median_block_ratio": statistics.median(blocks) if blocks else None,
            "block_ratio_quartiles": [bq[0], bq[2]],
            "median_paired_diff_ms": statistics.median([(b - a) * 1e3 for a, b in zip(loc, svc)]),
            "bit_identical": identical, "target_ratio": 1.15, "stages_us": stages}


STAGES = [("client", "start"), ("client", "built"), ("client", "sent"), ("service", "received"),
          ("service", "parsed"), ("service", "validated"), ("service", "resolved"), ("service", "prepared"),
          ("service", "launched"), ("service", "completed"), ("service", "reply_sent"), ("client", "received")]


def stage_medians(rows) -> list:
    """``[(label, median us)]`` between consecutive stages of ``CacheClient.last_timings`` rows (a
    stage a row does not have is passed over)."""
    vals: dict = {}
    for r in rows:
        present = [(w, k) for w, k in STAGES if k in r[w]]
        for (w0, k0), (w1, k1) in zip(present, present[1:]):
            vals.setdefault(f"{w0}.{k0} -> {w1}.{k1}", []).append((r[w1][k1] - r[w0][k0]) / 1e3)
    out = [(label, statistics.median(v)) for label, v in vals.items()]
    ends = [max(r["client"].values()) - r["client"]["start"] for r in rows]
    out.append(("total (client start -> returned)", statistics.median(ends) / 1e3))
    return out


def back_to_back(args, client, keys, channel_client=None) -> dict:
    """Each path run ``args.back_to_back`` times in a row (medians, us): the steady state of a
    worker that restores through one path only. The paired runs above alternate the paths, and on
    a GPU without MPS every switch between the client's and the service's CUDA contexts costs both
    paths alike; here the in-process path runs with no other context in between, the service path
    with the client on the default stream and on a side stream, both idle between requests (the
    client then records no interprocess event: nothing of its context runs between the service's
    copies)."""
    device = args.device
    layout, rope, plan, resident = child_setup(device, keys, args.inputs)
    shared, registrable, _ = _alloc(layout, device)
    local = layout.allocate(device, fill=0)
    placement = PlacementPlan(local, layout, rope=rope)
    restorer = ServiceRestorer(client, registrable, layout, model_fingerprint=child_fingerprint(), rope=rope)

    def timed(fn) -> float:
        for _ in range(5):
            fn()
        out = []
        for _ in range(args.back_to_back):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out) * 1e6

    rows = {"in_process": timed(lambda: in_process_restore(placement, resident, plan, device)),
            "service_default_stream": timed(lambda: restorer.restore(service_items(plan)))}
    compiled_ok = None
    if device == "cuda":
        local2 = layout.allocate(device, fill=0)
        placement2 = PlacementPlan(local2, layout, rope=rope)
        rows["in_process_compiled"] = timed(lambda: in_process_compiled(placement2, resident, plan, device))
        compiled_ok = torch.equal(_bytes(local), _bytes(local2))
    if device == "cuda":
        with torch.cuda.stream(torch.cuda.Stream()):
            rows["service_idle_side_stream"] = timed(lambda: restorer.restore(service_items(plan)))
    restorer.close()
    if channel_client is not None:
        through = ServiceRestorer(channel_client, registrable, layout, model_fingerprint=child_fingerprint(),
                                  rope=rope)
        rows["service_channel"] = timed(lambda: through.restore(service_items(plan)))
        through.close()
        through = None
    restorer = None
    registrable = None
    if shared is not None:
        shared.close()
    rows["ratios"] = {k: rows[k] / rows["in_process"] for k in rows if k.startswith("service")}
    if "service_channel" in rows and "in_process_compiled" in rows:
        rows["channel_to_in_process_compiled"] = rows["service_channel"] / rows["in_process_compiled"]
    return {"runs": args.back_to_back, "median_us": rows, "in_process_compiled_identical": compiled_ok}


def concurrent(args, client, socket_path, keys, on_start=None, on_end=None, channel: bool = False) -> dict:
    """``on_start()`` / ``on_end()``: called as the clients pass their start line and once every
    client has reported (tools measuring the service around the run). ``channel``: the clients
    restore through channels (``CacheClient(channel=True)``)."""
    ctx = mp.get_context("spawn")
    before = client.status()
    barrier, out = ctx.Barrier(args.clients + 1), ctx.Queue()
    procs = [ctx.Process(target=_client_proc,
                         args=(socket_path, args.device, args.rounds, args.reply_spin_s, args.inputs, keys, barrier,
                               out, channel))
             for _ in range(args.clients)]
    for p in procs:
        p.start()
    results = []
    try:
        barrier.wait(timeout=600)
        t0 = time.perf_counter()
        if on_start is not None:
            on_start()
        for _ in procs:
            results.append(out.get(timeout=600))
        wall = time.perf_counter() - t0
        if on_end is not None:
            on_end()
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
    deadline = time.monotonic() + 30
    while True:
        after = client.status()
        if not after["registrations"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    errors = [e for r in results for e in r["errors"]]
    times = [t for r in results for t in r["times"]]
    restores = args.clients * args.rounds
    # steady state: from the first client's start to the last one's end of its timed loop (every
    # client restored once before the start line), so process start-up, registration and the
    # per-registration first restore are outside the window
    starts = [r["start"] for r in results if r["start"] is not None]
    ends = [r["end"] for r in results if r["end"] is not None]
    window = max(ends) - min(starts) if starts and len(ends) == len(results) else None
    firsts = [r["first_s"] for r in results if r["first_s"] is not None]
    mem_key = "device_memory_allocated"
    served = [r["route_counts"] for r in results if r.get("route_counts")]
    return {"clients": args.clients, "rounds": args.rounds, "restores": restores, "errors": len(errors),
            "channel": channel, "through_channel": sum(c.get("channel", 0) for c in served),
            "through_socket": sum(c["socket"] for c in served),
            "error_samples": errors[:5], "wall_s": wall, "window_s": window,
            "restores_per_s": restores / window if window else None,
            "latency_median_ms": statistics.median(times) * 1e3 if times else None,
            "latency_p90_ms": float(np.percentile(times, 90)) * 1e3 if times else None,
            "first_restore_median_ms": statistics.median(firsts) * 1e3 if firsts else None,
            "registrations_after": len(after["registrations"]), "pending_ops_after": len(after["pending_ops"]),
            "open_ipc_mappings_before": before["open_ipc_mappings"], "open_ipc_mappings_after": after["open_ipc_mappings"],
            "device_memory_before": before.get(mem_key), "device_memory_after": after.get(mem_key),
            "service_device_originals_bytes": after["originals"].get("device_bytes"),
            "memory_back_to_baseline": before.get(mem_key) == after.get(mem_key)
            and after["open_ipc_mappings"] == before["open_ipc_mappings"] and not after["registrations"]}


def _echo_proc(path: str, spin_s: float) -> None:
    """The transport floor's far end: reads a frame as the service does (blocking socket, polling
    with ``MSG_DONTWAIT`` for ``spin_s`` first) and answers each with a small frame."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    reply = protocol.encode({"id": 0, "ok": True})
    try:
        while True:
            protocol.read_frame(sock, spin_s=spin_s)
            sock.sendall(reply)
    except (protocol.ConnectionClosed, OSError):
        pass
    finally:
        sock.close()


def transport_floor(args, request_bytes: int, spins: dict) -> dict:
    """What any restore through a separate process pays before the service does anything: a frame
    of the seed request's size to another process and a small frame back, both read by
    ``protocol.read_frame`` with the benchmark's polling, no work in between (medians, us)."""
    sock_dir = tempfile.mkdtemp(prefix="kmsf-")
    path = os.path.join(sock_dir, "echo.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    proc = mp.get_context("spawn").Process(target=_echo_proc, args=(path, spins["receive_spin_s"]))
    proc.start()
    try:
        listener.settimeout(120)
        conn, _ = listener.accept()
        conn.settimeout(300)  # as CacheClient's socket: a timeout, polled with the socket non-blocking
        frame = protocol.encode({"op": "echo"}, bytes(request_bytes))
        times = []
        for i in range(args.floor_rounds + 20):
            t0 = time.perf_counter()
            conn.sendall(frame)
            protocol.read_frame(conn, frame_timeout=300, spin_s=spins["reply_spin_s"])
            if i >= 20:
                times.append(time.perf_counter() - t0)
        conn.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        listener.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    q = statistics.quantiles(times, n=4)
    return {"rounds": len(times), "request_frame_bytes": len(frame), "median_us": statistics.median(times) * 1e6,
            "quartiles_us": [q[0] * 1e6, q[2] * 1e6]}


def shape_sweep(args, client, socket_path, keys) -> list:
    """The paired comparison into per-layer allocations (``--per-layer-pairs``; vLLM's own) and for
    larger children (``--shapes``): the service's fixed cost against the restore's size."""
    rows = []
    if args.per_layer_pairs > 0:
        r = paired(args, client, socket_path, keys, SEED, pairs=args.per_layer_pairs, timing_runs=0, per_layer=True)
        rows.append({"shape": {**dataclasses.asdict(SEED), "name": "seed, per-layer"}, "per_layer": True,
                     "child_mib": SEED.child_bytes / 2**20,
                     **{k: r[k] for k in ("in_process_median_ms", "service_median_ms", "median_paired_ratio",
                                          "paired_ratio_quartiles", "median_block_ratio", "median_paired_diff_ms",
                                          "bit_identical")}})
    for name in [n for n in args.shapes.split(",") if n]:
        shape = SHAPES[name]
        shape_keys = put_originals(client, shape)
        r = paired(args, client, socket_path, shape_keys, shape, pairs=args.shape_pairs, timing_runs=0)
        for key in shape_keys:
            client.evict(key)
        rows.append({"shape": dataclasses.asdict(shape), "per_layer": False, "child_mib": shape.child_bytes / 2**20,
                     **{k: r[k] for k in ("in_process_median_ms", "service_median_ms", "median_paired_ratio",
                                          "paired_ratio_quartiles", "median_block_ratio", "median_paired_diff_ms",
                                          "bit_identical")}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pairs", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timing-runs", type=int, default=21, help="restores with a per-stage breakdown (0: none)")
    ap.add_argument("--back-to-back", type=int, default=41,
                    help="restores per path run in a row for the steady-state figures (0: skip them)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--inputs", choices=("tensors", "lists"), default="tensors",
                    help="index inputs of both paths: int64 CPU tensors made once, or Python lists converted "
                         "inside the timed region by both (see the module docstring)")
    ap.add_argument("--reply-spin-s", type=float, default=None,
                    help="CacheClient(reply_spin_s=...): seconds to poll for a reply (default: auto)")
    ap.add_argument("--receive-spin-s", type=float, default=None,
                    help="ServiceConfig.receive_spin_s: seconds to poll for a request (default: auto)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated larger children for the paired comparison ("
                         + ", ".join(k for k in SHAPES if k != "seed") + "; default: all of them on cuda, none on cpu)")
    ap.add_argument("--shape-pairs", type=int, default=11, help="pairs per larger child")
    ap.add_argument("--per-layer-pairs", type=int, default=None,
                    help="pairs of the seed child restored into one allocation per layer (default: 21 on cuda, "
                         "0 on cpu; 0: skip)")
    ap.add_argument("--floor-rounds", type=int, default=201,
                    help="round trips of the transport floor (0: skip it)")
    ap.add_argument("--no-channel", action="store_true",
                    help="skip the channel's runs (CacheClient(channel=True); on cuda they run by default)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = ap.parse_args(argv)
    if args.shapes is None:
        args.shapes = "7b,70b" if args.device == "cuda" else ""
    if args.per_layer_pairs is None:
        args.per_layer_pairs = 21 if args.device == "cuda" else 0
    unknown = [n for n in args.shapes.split(",") if n and n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {sorted(SHAPES)}")
    sock_dir = tempfile.mkdtemp(prefix="kmsb-")
    socket_path = os.path.join(sock_dir, "svc", "kmesh.sock")
    cfg = ServiceConfig(socket_path=socket_path, host_budget_bytes=1 << 30, receive_spin_s=args.receive_spin_s)
    channels = args.device == "cuda" and not args.no_channel
    with CacheService(cfg), CacheClient(socket_path, timeout=300, reply_spin_s=args.reply_spin_s,
                                        channel=False) as client, \
            CacheClient(socket_path, timeout=300, reply_spin_s=args.reply_spin_s, channel=True) as channel_client:
        spins = {"reply_spin_s": client.reply_spin_s,
                 "receive_spin_s": protocol.spin_default(args.receive_spin_s, 2e-3)}
        keys = put_originals(client)
        pair = paired(args, client, socket_path, keys)
        channel_pair = None
        if channels:
            channel_pair = paired(args, channel_client, socket_path, keys, timing_runs=0)
            channel_pair["served"] = dict(channel_client.route_counts)
        steady = back_to_back(args, client, keys, channel_client if channels else None) \
            if args.back_to_back > 0 else None
        sweep = shape_sweep(args, client, socket_path, keys)
        conc = concurrent(args, client, socket_path, keys) if args.clients > 0 else None
        conc_channel = concurrent(args, client, socket_path, keys, channel=True) \
            if args.clients > 0 and channels else None
        channel_status = client.status().get("channels")
        counters = client.status()["counters"]
        placements = {k: counters.get(k) for k in ("placements_one_prepare", "placements_two_prepares")}
    shutil.rmtree(sock_dir, ignore_errors=True)
    floor = None
    if args.floor_rounds > 0:
        request_bytes = 2 * SEGMENTS * SEG_TOKENS * 8  # the seed request's body: slots and new positions
        floor = transport_floor(args, request_bytes, spins)
        if steady:
            floor["share_of_in_process_back_to_back"] = floor["median_us"] / steady["median_us"]["in_process"]
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    report = {"device": args.device, "device_name": dev_name, "torch": torch.__version__,
              "workload": {"segments": SEGMENTS, "tokens_per_segment": SEG_TOKENS, "layers": LAYERS, "kv_heads": HEADS,
                           "head_size": HEAD, "dtype": "bfloat16", "prompt_tokens": PROMPT, "block_size": BLOCK},
              "index_inputs": args.inputs, "polling": spins, "paired": pair, "back_to_back": steady,
              "concurrent": conc, "service_placements": placements, "channel_paired": channel_pair,
              "channel_concurrent": conc_channel, "channel_status": channel_status,
              "transport_floor": floor, "larger_children": sweep,
              "command": "python perf/bench_service.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_service_{args.device}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"cache service restore, seed-size child ({SEGMENTS}x{SEG_TOKENS} tokens, {LAYERS} layers, bf16) "
          f"on {args.device} ({dev_name})")
    print(f"polling: client {spins['reply_spin_s'] * 1e6:.0f} us, service {spins['receive_spin_s'] * 1e6:.0f} us; "
          f"index inputs: {args.inputs} (both paths)")
    print(f"{'path':<14}{'median ms':>12}")
    print(f"{'in-process':<14}{pair['in_process_median_ms']:>12.3f}")
    print(f"{'service':<14}{pair['service_median_ms']:>12.3f}")
    lo, hi = pair["paired_ratio_quartiles"]
    print(f"median paired ratio service/in-process: {pair['median_paired_ratio']:.3f} (quartiles {lo:.3f}..{hi:.3f}; "
          f"target <= 1.15), median paired diff {pair['median_paired_diff_ms']:.3f} ms, "
          f"bit-identical: {pair['bit_identical']}")
    if pair["median_block_ratio"] is not None:
        lo, hi = pair["block_ratio_quartiles"]
        print(f"median ratio over balanced blocks of two pairs (in-process, service, service, in-process): "
              f"{pair['median_block_ratio']:.3f} (quartiles {lo:.3f}..{hi:.3f})")
    if steady:
        m = steady["median_us"]
        print(f"back to back ({steady['runs']} restores per path, medians): in-process {m['in_process']:.1f} us, "
              + ", ".join(f"{k.replace('_', ' ')} {m[k]:.1f} us ({r:.2f}x)" for k, r in m["ratios"].items()))
        if "in_process_compiled" in m:
            through = (f"; the channel {m['channel_to_in_process_compiled']:.2f}x of it"
                       if "channel_to_in_process_compiled" in m else "")
            print(f"  in-process through the compiled single call (PlacementPlan.place): "
                  f"{m['in_process_compiled']:.1f} us, bit-identical to prepare and run: "
                  f"{steady['in_process_compiled_identical']}{through}")
    if pair["stages_us"]:
        print(f"service path stages, median of {args.timing_runs} restores (us):")
        for label, us in pair["stages_us"]:
            print(f"  {label:<42}{us:>10.1f}")
    if channel_pair:
        lo, hi = channel_pair["paired_ratio_quartiles"]
        blk = channel_pair["median_block_ratio"]
        print(f"channel (CacheClient(channel=True)), paired with the in-process restore: medians "
              f"{channel_pair['in_process_median_ms']:.3f} / {channel_pair['service_median_ms']:.3f} ms, paired ratio "
              f"{channel_pair['median_paired_ratio']:.3f} (quartiles {lo:.3f}..{hi:.3f}), balanced blocks "
              + (f"{blk:.3f}" if blk is not None else "n/a")
              + f", bit-identical: {channel_pair['bit_identical']}, served {channel_pair['served']}")
    for name, c in (("", conc), (" through channels", conc_channel)):
        if not c:
            continue
        rate = f"{c['restores_per_s']:.1f}" if c["restores_per_s"] else "n/a"
        lat = (f"median latency {c['latency_median_ms']:.2f} ms (p90 {c['latency_p90_ms']:.2f}), "
               if c["latency_median_ms"] is not None else "")
        first = (f"first restore per client {c['first_restore_median_ms']:.2f} ms, "
                 if c["first_restore_median_ms"] is not None else "")
        served = f", served channel/socket {c['through_channel']}/{c['through_socket']}" if c["channel"] else ""
        print(f"{c['clients']} concurrent clients{name} x {c['rounds']} restores: {rate} restores/s (steady state), "
              f"{lat}{first}errors {c['errors']}, memory back to baseline: {c['memory_back_to_baseline']}{served}")
    if floor:
        share = (f" = {floor['share_of_in_process_back_to_back']:.2f}x the in-process restore back to back "
                 f"(the target allows the service 0.15x above it)" if "share_of_in_process_back_to_back" in floor else "")
        print(f"transport floor (a {floor['request_frame_bytes']}-byte frame to another process and a small one back, "
              f"protocol.read_frame on both ends, no work): median {floor['median_us']:.1f} us "
              f"(quartiles {floor['quartiles_us'][0]:.1f}..{floor['quartiles_us'][1]:.1f}){share}")
    if sweep:
        print("per-layer allocations and larger children (same token structure; paired, alternating; medians):")
        print(f"  {'shape':<16}{'child MiB':>10}{'in-process ms':>15}{'service ms':>12}{'diff ms':>9}"
              f"{'paired ratio':>14}{'blocks':>8}  bit-identical")
        for r in sweep:
            blk = f"{r['median_block_ratio']:.3f}" if r["median_block_ratio"] is not None else "n/a"
            print(f"  {r['shape']['name']:<16}{r['child_mib']:>10.1f}{r['in_process_median_ms']:>15.3f}"
                  f"{r['service_median_ms']:>12.3f}{r['median_paired_diff_ms']:>9.3f}{r['median_paired_ratio']:>14.3f}"
                  f"{blk:>8}  {r['bit_identical']}")
    print(f"service placements in one prepare of the request body as it is: {placements['placements_one_prepare']}, "
          f"in two (shifted and plain items mixed): {placements['placements_two_prepares']}")
    print(f"wrote {path}")
    ok = pair["bit_identical"] and all(r["bit_identical"] for r in sweep) \
        and (channel_pair is None or channel_pair["bit_identical"]) \
        and (steady is None or steady["in_process_compiled_identical"] is not False)
    return 0 if ok and all(c is None or c["errors"] == 0 for c in (conc, conc_channel)) else 1


if __name__ == "__main__":
    sys.exit(main())
