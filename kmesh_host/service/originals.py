"""The shared originals the cache service owns: segments of a :class:`~kmesh_host.SegmentStore`,
held in host RAM by a :class:`~kmesh_host.HostTier` and copied to each GPU that restores them.

One key space: a key is the store's (content-derived, as :meth:`SegmentStore.put` returns it and the
in-process restorer reads it), so an original never changes under its key. :class:`Originals`:

* ``put`` writes a segment to the store and makes it resident in the tier; a save publishes its
  gathered bytes the same way once its copy has drained;
* restores take tier leases (:meth:`Originals.lease_many`: resident, or loaded with O_DIRECT reads
  through the tier, concurrent loads of one key joined), and on a GPU the device copies
  (:class:`DeviceOriginals`) made from them;
* ``evict`` drops a key from the host tier and the device copies; its store file stays.

Verification: every original is checked by the tier's host SHA-256 as it enters the tier (from the
store, whoever wrote the file); device copies are made from those checked bytes, so a restore from
a resident entry or a device copy checks nothing again.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kmesh_gpu.errors import KmeshError

from ..segment import ModelFingerprint, Segment, SegmentHeader, check_fingerprint, segment_from_payload
from ..store import SegmentStore
from ..tier import HostLease, HostTier, HostTierConfig


@dataclass
class DeviceCopy:
    """A device copy of one original. ``ready``: CUDA event after its upload (streams that read
    ``kv`` wait on it until the upload is known to have finished; ``None``: nothing to wait for).
    ``header``: the original's (its fingerprint, shape and positions). ``uploaded``: set once a
    query saw ``ready`` complete (it never un-completes: the event is recorded once)."""

    kv: torch.Tensor
    ready: object  # torch.cuda.Event or None
    header: SegmentHeader
    uploaded: bool = False

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class DeviceOriginals:
    """Device copies of originals, made from a restore's leases, up to ``budget_bytes`` per device.

    Called by the service's restore path (any thread): :meth:`get_many` looks copies up,
    :meth:`add` uploads one from a tier lease (on this tier's stream, the lease fenced by the
    upload's event) or returns ``None`` when it cannot fit (the caller then uploads for the one
    request). :meth:`drop` is called by ``evict`` after the host tier has let the key go. Least
    recently used copies make room for new ones.

    ``is_current(key)``: whether the host tier still holds ``key``; a copy is added only while it
    does (checked under this tier's lock), so a restore that looked a key up before an evict and
    uploads it after does not leave a copy of the evicted key behind.

    Ownership: dropping an entry drops this tier's reference only. An operation that reads the copy
    holds it in its keepalive until its drain (physical completion), so the memory returns to
    torch's allocator only after every copy out of it has finished.
    """

    def __init__(self, budget_bytes: int, *, is_current=None, on_drop=None):
        self.budget_bytes = int(budget_bytes)
        self._is_current = is_current
        #: ``on_drop(key)``: told of every copy this tier stops holding (the service's channels then
        #: drop the rows that name it), after the tier's lock is released
        self._on_drop = on_drop
        self._dropped: list[str] = []
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, int], DeviceCopy] = OrderedDict()
        self._bytes: dict[int, int] = {}
        self._streams: dict[int, object] = {}

    @staticmethod
    def _index(device: torch.device) -> int:
        return device.index if device.index is not None else torch.cuda.current_device()

    def get_many(self, keys, device: torch.device) -> list[DeviceCopy | None]:
        """The copies of ``keys`` on ``device`` (``None`` where there is none), under one acquisition
        of the lock."""
        index = self._index(device)
        out = []
        with self._lock:
            entries = self._entries
            for key in keys:
                entry = entries.get((key, index))
                if entry is not None:
                    entries.move_to_end((key, index))
                out.append(entry)
        return out

    def add(self, key: str, lease: HostLease, device: torch.device) -> DeviceCopy | None:
        """The copy of ``key`` on ``device``, uploaded from ``lease`` first if there is none (the lease
        is fenced by the upload: the caller may release it at once); ``None`` when it does not fit."""
        try:
            return self._add(key, lease, device)
        finally:
            if self._dropped:
                self._tell_dropped()

    def _add(self, key: str, lease: HostLease, device: torch.device) -> DeviceCopy | None:
        index = self._index(device)
        header = lease.header
        nbytes = header.payload_length
        with self._lock:
            entry = self._entries.get((key, index))
            if entry is not None:
                self._entries.move_to_end((key, index))
                return entry
            if nbytes > self.budget_bytes:
                return None
            if self._is_current is not None and not self._is_current(key):
                return None  # evicted (or never retained) since the caller looked it up: not kept
            for k in [k for k in self._entries if k[1] == index]:  # least recently used first
                if self._bytes.get(index, 0) + nbytes <= self.budget_bytes:
                    break
                self._remove(k)
            # Upload under the lock: concurrent first uses of one key upload it once. Submitting an
            # asynchronous copy from pinned memory takes microseconds; nobody waits for it here.
            kv, ready = self._upload(lease, index)
            if ready is not None:
                lease.fence(ready)
            entry = DeviceCopy(kv, ready, header, uploaded=ready is None)
            self._entries[(key, index)] = entry
            self._bytes[index] = self._bytes.get(index, 0) + entry.nbytes
            return entry

    def _upload(self, lease: HostLease, index: int):
        """Queue the lease's kv bytes' copy to device ``index`` on this tier's stream: (copy, its ready event)."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        with torch.cuda.device(index), torch.cuda.stream(stream):
            kv = lease.kv.to(torch.device("cuda", index), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return kv, ready

    @staticmethod
    def order_after_upload(entry: DeviceCopy, stream) -> None:
        """Make work queued next on ``stream`` read ``entry.kv`` only after its upload: a stream wait
        while the upload may be running, nothing once a query has seen it finished."""
        if entry.uploaded:
            return
        if entry.ready.query():
            entry.uploaded = True
        else:
            stream.wait_event(entry.ready)

    def _remove(self, k: tuple[str, int]) -> None:
        entry = self._entries.pop(k)
        self._bytes[k[1]] -= entry.nbytes
        if self._on_drop is not None:
            self._dropped.append(k[0])

    def _tell_dropped(self) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for key in dropped:
            self._on_drop(key)

    def current(self, key: str, device: torch.device) -> DeviceCopy | None:
        """The copy of ``key`` this tier holds on ``device`` now (no upload, no reordering)."""
        index = self._index(device)
        with self._lock:
            return self._entries.get((key, index))

    def drop(self, key: str) -> int:
        """Forget every device copy of ``key``; returns how many there were."""
        with self._lock:
            keys = [k for k in self._entries if k[0] == key]
            for k in keys:
                self._remove(k)
        if self._dropped:
            self._tell_dropped()
        return len(keys)

    def stats(self) -> dict:
        with self._lock:
            return {"device_keys": len(self._entries), "device_bytes": sum(self._bytes.values()),
                    "device_budget_bytes": self.budget_bytes}


def release_all(leases) -> None:
    """Release every lease of ``leases`` (``None`` entries skipped), whatever the others do."""
    for lease in leases:
        if lease is not None:
            lease.release()


class Originals:
    """The service's originals: its segment store, the host tier over it and the device copies.

    ``store_root``: the store (``None``: a private one in a new directory under ``private_dir``,
    removed by :meth:`close`). ``host_budget_bytes``: the tier's buffers (page-locked where
    ``pin``); ``device_budget_bytes``: device copies kept per GPU. ``on_drop(key)``: told of every
    device copy dropped.
    """

    def __init__(self, store_root: str | None, *, private_dir: str, host_budget_bytes: int, device_budget_bytes: int,
                 pin: bool, on_drop=None):
        self.private_root = None
        if store_root is None:
            self.private_root = tempfile.mkdtemp(prefix=".kmesh-store-", dir=private_dir)
        self.store = SegmentStore(store_root if store_root is not None else self.private_root)
        self.tier = HostTier(self.store, HostTierConfig(budget_bytes=int(host_budget_bytes), pin=pin, retain=True,
                                                         singleflight=True, verify="sha256"))
        self.device = DeviceOriginals(device_budget_bytes, is_current=self.tier.__contains__, on_drop=on_drop)
        self.host_budget_bytes = int(host_budget_bytes)

    # ------------------------------------------------------------------ writing
    def put(self, kv: torch.Tensor, token_ids, positions, *, model_fingerprint: ModelFingerprint) -> str:
        """Write a segment to the store (``SegmentStore.put``: checked against the fingerprint) and make
        it resident in the tier, read back and checked as any entry is; returns its key. A segment the
        tier cannot hold (over its budget) is published all the same: restores then read it."""
        key = self.store.put(kv, token_ids, positions, model_fingerprint=model_fingerprint)
        try:
            self.tier.acquire(key, model_fingerprint=model_fingerprint).release()
        except KmeshError:  # residency is a cache: the store holds the segment
            pass
        return key

    # ------------------------------------------------------------------ reading
    def lease_many(self, keys, model_fingerprint: ModelFingerprint) -> list[HostLease]:
        """A tier lease per key (resident ones under one lock, the rest read through the tier); raises
        the first key's typed error (``SegmentNotFound``, ``FingerprintMismatch``,
        ``IntegrityError``, ``BudgetExceeded``, ...) holding nothing."""
        leases = self.tier.acquire_resident_many(keys, model_fingerprint=model_fingerprint)
        try:
            for i, lease in enumerate(leases):
                if lease is None:
                    leases[i] = self.tier.acquire(keys[i], model_fingerprint=model_fingerprint)
        except BaseException:
            release_all(leases)
            raise
        return leases

    def get(self, key: str, *, model_fingerprint: ModelFingerprint) -> Segment:
        """The segment ``key`` read through the tier, as a copy of its bytes (``kv`` on the CPU)."""
        lease = self.tier.acquire(key, model_fingerprint=model_fingerprint)
        try:
            payload = lease.payload[:lease.header.payload_length].clone()
            return segment_from_payload(lease.header, payload)
        finally:
            lease.release()

    @staticmethod
    def check(copies, model_fingerprint: ModelFingerprint) -> None:
        """The fingerprint check the tier makes, for originals served from their device copies."""
        for copy in copies:
            check_fingerprint(copy.header, model_fingerprint)

    # ------------------------------------------------------------------ eviction and state
    def evict(self, key: str) -> bool:
        """Drop ``key`` from the host tier and its device copies (the host tier first: a restore that
        looked it up before and uploads it after finds it gone and keeps no copy). The store file
        stays: a later restore reads it again. ``True`` when anything was dropped."""
        resident = key in self.tier
        self.tier.evict(key)
        dropped = self.device.drop(key)
        return resident or dropped > 0

    def stats(self) -> dict:
        tier = self.tier
        return {"store_root": self.store.root, "store_private": self.private_root is not None,
                "host_keys": len(tier.resident()), "host_bytes": tier.resident_bytes,
                "host_budget_bytes": self.host_budget_bytes, "host_pinned": tier.pin, "tier": dict(tier.stats),
                **self.device.stats()}

    def close(self) -> None:
        """Free the tier's buffers (after every lease was released) and remove a private store."""
        self.tier.close()
        if self.private_root is not None:
            shutil.rmtree(self.private_root, ignore_errors=True)
            self.private_root = None


__all__ = ["DeviceCopy", "DeviceOriginals", "Originals", "release_all"]
