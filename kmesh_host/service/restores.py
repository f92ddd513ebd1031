"""The socket restore, the service's hot path: a decoded request (:mod:`.restore_wire`) authorised,
its originals found, its items and slots checked against the registration, its blocks reserved, its
placement prepared from the body's arrays as they are and launched on the registration's stream,
and (``wait``) its completion observed.

Fixed cost per request is kept small because a restore's own work is a millisecond or two: the
request's int64 index arrays are used in place (views of the received frame); the slots are checked
and the blocks reserved in one compiled pass each (:mod:`._compiled`; the NumPy path decides unusual
requests and names errors) against one array of block holders per registration; what a
registration's items need beyond their arrays (:class:`ItemPlan`) is derived once per distinct item
list (an original never changes under its key); originals with device copies are looked up under
one lock and read nothing from the host tier; the request's prepare is one call of the
registration's :class:`~kmesh_gpu.PlacementPlan` (two where shifted and plain items mix); a
synchronous request's completion event is recorded again by the registration's next copy.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kmesh_gpu.errors import LayoutError

from . import _compiled
from .completions import CudaEventCompletion
from .operations import Activity, Operations, check_inject
from .originals import Originals, release_all
from .registrations import Destination, Registrations
from .registry import Op, PeerIdentity, Registry
from .restore_wire import RestoreRequest

#: distinct item lists whose checks a registration remembers (see :func:`item_plan`)
_PLANS_KEPT = 64
#: completion events a registration keeps for reuse (as many as it has had requests at once)
_EVENTS_KEPT = 8
_FP8 = (torch.uint8, torch.float8_e4m3fn)


class ItemPlan:
    """What a restore's items need beyond their index arrays, derived from the registration and the
    originals they name: the per-item checks passed, which items shift, how the body splits into
    per-item arrays, the shifted items' stored positions. Valid for as long as the registration
    lives: an original never changes under its key, and a registration's layout and RoPE spec never
    change."""

    __slots__ = ("shifted", "plain", "split_sizes", "num_positions", "starts", "check_params", "counts",
                 "old_positions", "old_per_item")

    def __init__(self, headers, slot_counts, position_counts, num_positions, reg):
        self.shifted = [i for i, c in enumerate(position_counts) if c is not None]
        self.plain = [i for i, c in enumerate(position_counts) if c is None]
        #: the body's arrays in its order: every item's slots, then the shifted items' new positions
        self.split_sizes = list(slot_counts) + [position_counts[i] for i in self.shifted]
        self.num_positions = num_positions
        #: the compiled slot check's arguments (see :func:`restore_blocks`): each item's first slot
        #: in the body, and the registration's slot count, block size and the positions' bound
        self.starts = np.cumsum([0, *slot_counts], dtype=np.int64)
        self.check_params = np.array([reg.num_slots, reg.block_size, num_positions or 0], dtype=np.int64)
        self.counts = tuple(slot_counts)  # each item's token count
        #: the shifted items' stored positions, end to end (one prepare) and per item (two); none
        #: without ``headers`` (a plan made for the slot check alone)
        self.old_per_item = [headers[i].positions_int64 for i in self.shifted] if headers else []
        self.old_positions = np.ascontiguousarray(np.concatenate([p.numpy() for p in self.old_per_item]),
                                                  dtype=np.int64) if self.old_per_item else None


def _dtype_fits(stored: torch.dtype, cache: torch.dtype) -> bool:
    return stored == cache or (stored in _FP8 and cache in _FP8)


def item_plan(dest: Destination, reg, req: RestoreRequest, headers) -> ItemPlan:
    """Check ``req``'s items against the originals' ``headers`` and the registration (shapes, dtype,
    slot and position counts, RoPE); the result is remembered on the destination for the same item
    list (the same keys name the same originals: their checks would pass again)."""
    signature = (req.keys, req.slot_counts, req.position_counts)
    memo = dest.item_plans
    plan = memo.get(signature)
    if plan is not None:
        return plan
    rope, layout = dest.rope, dest.layout
    L, _, H, _, D = layout.sizes
    for i, (key, count, shift, header) in enumerate(zip(req.keys, req.slot_counts, req.position_counts, headers)):
        shape, dtype = tuple(header.shape), header.torch_dtype
        T = shape[2]
        if shape != (2, L, T, H, D) or not _dtype_fits(dtype, layout.dtype):
            raise LayoutError(f"items[{i}]: original {key!r} is {shape} {dtype}, the "
                              f"registration holds (2, {L}, T, {H}, {D}) {layout.dtype}")
        if count != T:
            raise LayoutError(f"items[{i}].slots: expected {T} slots (the original's tokens), got {count}")
        if shift is not None:
            if rope is None:
                raise LayoutError(f"items[{i}].new_positions: the registration has no RoPE spec to shift with")
            if shift != T:
                raise LayoutError(f"items[{i}].new_positions: expected {T} positions, got {shift}")
    plan = ItemPlan(headers, req.slot_counts, req.position_counts, dest.num_positions, reg)
    if len(memo) >= _PLANS_KEPT:
        memo.clear()
    memo[signature] = plan
    return plan


def restore_blocks(registry: Registry, reg, req: RestoreRequest, plan: ItemPlan) -> np.ndarray:
    """The blocks ``req`` writes, sorted and unique, once its slots and new positions are checked.

    The security boundary (DESIGN.md §5): every slot in [-1, num_slots) of this registration and
    none twice, every new position in range, before anything is reserved or submitted. The usual
    request is checked in one compiled pass (:mod:`._compiled`); anything else, errors included,
    by the NumPy path, which names what is wrong."""
    compiled = _compiled.compiled()
    values = req.values
    # the compiled signature takes writable C-contiguous int64 only (np.frombuffer of bytes is read-only)
    if (compiled is not None and values is not None and values.dtype == np.int64 and values.flags.c_contiguous
            and values.flags.writeable):
        out = np.empty(len(req.slots), dtype=np.int64)
        count = compiled.restore_blocks(values, plan.starts, plan.check_params, out)
        if count >= 0:
            return out[:count]
    pos = req.new_positions
    # one reduction: viewed as unsigned, a negative position is larger than any valid one
    if pos.size and int(np.maximum.reduce(pos.view(np.uint64))) >= plan.num_positions:
        j = int(np.flatnonzero((pos < 0) | (pos >= plan.num_positions))[0])
        ends = np.cumsum([c or 0 for c in req.position_counts])
        i = int(np.searchsorted(ends, j, side="right"))
        raise LayoutError(f"items[{i}].new_positions: {int(pos[j])} outside [0, {plan.num_positions})")
    return registry.block_ids_of_slots(reg, req.slots, name="items[*].slots")


class Restores:
    """The socket restore (see the module docstring)."""

    def __init__(self, registry: Registry, originals: Originals, registrations: Registrations,
                 operations: Operations, activity: Activity, *, allow_fault_injection: bool):
        self.registry, self.originals, self.registrations = registry, originals, registrations
        self.operations, self.activity = operations, activity
        self.allow_fault_injection = allow_fault_injection

    def restore(self, req: RestoreRequest, peer: PeerIdentity, conn_id: int, stamps: dict | None = None) -> Op:
        """A decoded restore request: checks, reserves, submits and (``req.wait``) drains; returns the Op."""
        registry = self.registry
        reg = registry.authorize(req.reg_id, req.secret, peer)
        inject = check_inject(req.inject, self.allow_fault_injection)
        dest: Destination = reg.destination
        keys = req.keys
        fingerprint = dest.model_fingerprint
        device_copies = self.originals.device
        copies = leases = None  # per item: its device copy / its tier lease (or None)
        if dest.on_cuda:
            copies = device_copies.get_many(keys, dest.device)
            missing = [i for i, c in enumerate(copies) if c is None]
            if missing:
                got = self.originals.lease_many([keys[i] for i in missing], fingerprint)
                leases = [None] * len(keys)
                for i, lease in zip(missing, got):
                    leases[i] = lease
        else:
            leases = self.originals.lease_many(keys, fingerprint)
        try:
            if copies is not None:
                self.originals.check([c for c in copies if c is not None], fingerprint)
                headers = [c.header if c is not None else leases[i].header for i, c in enumerate(copies)]
            else:
                headers = [lease.header for lease in leases]
            plan = item_plan(dest, reg, req, headers)
            blocks = restore_blocks(registry, reg, req, plan)
            client_event = self.registrations.client_event(req.wait_event, reg, conn_id) \
                if req.wait_event is not None else None
            op = registry.begin(reg, "restore", blocks, keys)
        except BaseException:
            if leases is not None:
                release_all(leases)
            raise
        if stamps is not None:
            stamps["validated"] = time.monotonic_ns()
        held = leases  # released by the enqueue once fenced, or when the operation drains

        def enqueue(keepalive):
            if copies is not None:
                kvs = self._device_sources(dest, keys, copies, held)
                keepalive.extend(kvs)
            else:
                kvs = [lease.kv for lease in held]
            if stamps is not None:
                stamps["resolved"] = time.monotonic_ns()
            launches = self._prepare(dest, req, plan, kvs)
            if stamps is not None:
                stamps["prepared"] = time.monotonic_ns()
            for launch in launches:
                launch.run()
            if stamps is not None:
                stamps["launched"] = time.monotonic_ns()

        def on_drained(_op):
            if held is not None:
                release_all(held)

        self.operations.submit(reg, op, inject, enqueue, client_event=client_event,
                               on_drained=on_drained if held is not None else None)
        if req.wait:
            self.operations.finish(op, True, req.timeout)
            completion = op.completion
            # Its copy has finished: the event may serve the registration's next copy (creating
            # and destroying an event per request costs more than recording one again).
            if type(completion) is CudaEventCompletion and len(dest.free_events) < _EVENTS_KEPT:
                dest.free_events.append(completion.event)
        if stamps is not None:
            stamps["completed"] = time.monotonic_ns()
        return op

    def _device_sources(self, dest: Destination, keys, copies, leases) -> list:
        """The items' device copies (made from their leases where missing: each lease released once
        its upload is fenced; kept until the drain where the copy is for this request only), ordered
        after their uploads on the registration's stream."""
        device_copies, stream = self.originals.device, dest.stream
        kvs = []
        for i, copy in enumerate(copies):
            if copy is None:
                lease = leases[i]
                copy = device_copies.add(keys[i], lease, dest.device)
                if copy is None:  # over the device budget: uploaded for this request only
                    kvs.append(lease.kv.to(dest.device, non_blocking=True))
                    continue
                leases[i] = None
                lease.release()
            if not copy.uploaded:
                device_copies.order_after_upload(copy, stream)
            kvs.append(copy.kv)
        return kvs

    def _prepare(self, dest: Destination, req: RestoreRequest, plan: ItemPlan, kvs) -> list:
        """The placement's launches: one prepare of the body's arrays as they are, or (shifted and
        plain items mixed) one per kind from per-item views of the body (the frame's buffer is the
        operation's own)."""
        shifted, plain = plan.shifted, plan.plain
        if not plain:
            self.activity.count("placements_one_prepare")
            return [dest.shifted.prepare(kvs, req.slots, old_positions=plan.old_positions,
                                         new_positions=req.new_positions)]
        if not shifted:
            self.activity.count("placements_one_prepare")
            return [dest.plain.prepare(kvs, req.slots)]
        self.activity.count("placements_two_prepares")
        values = req.values if req.values is not None else np.concatenate((req.slots, req.new_positions))
        index = torch.from_numpy(values).split_with_sizes(plan.split_sizes)
        n = len(kvs)
        return [dest.shifted.prepare([kvs[i] for i in shifted], [index[i] for i in shifted],
                                     old_positions=plan.old_per_item, new_positions=list(index[n:])),
                dest.plain.prepare([kvs[i] for i in plain], [index[i] for i in plain])]
