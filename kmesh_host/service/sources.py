"""Where the cache service finds the shared originals it restores from.

The contract is :class:`SourceProvider`; the service holds one :class:`TieredSource`: the
host-RAM tier (:class:`HostOriginals`) first, then, when a store root is configured, the segment store
(:class:`StoreSource`), whose hits are retained in the host tier for later children.
:class:`DeviceOriginals` keeps device copies of originals that restores have used, so a restore
into GPU memory does not upload its originals again.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kmesh_gpu.errors import FingerprintMismatch, KmeshError, LayoutError, SegmentNotFound


@dataclass(frozen=True)
class SourceSegment:
    """One shared original, never modified once published.

    Attributes:
        kv: ``(2, L, T, H, D)`` in the model dtype, on the CPU (pinned where CUDA is present);
            keys post-RoPE at ``positions``.
        positions: ``int64[T]``, the positions the keys were rotated for.
        token_ids: ``int64[T]`` or ``None``.
        fingerprint: the ``ModelFingerprint`` a segment-store original was saved with (``None`` for
            originals put or saved through the service); a request must name it to be served.
    """

    kv: torch.Tensor
    positions: torch.Tensor
    token_ids: torch.Tensor | None = None
    fingerprint: object = None

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @functools.cached_property
    def signature(self) -> tuple:
        """``(shape, dtype)`` of ``kv``, looked up once (a restore checks it for every item)."""
        return tuple(self.kv.shape), self.kv.dtype


def _model_fingerprint(model_fingerprint):
    """A request's model fingerprint (a dict from the wire) as a ``ModelFingerprint``, or ``None``."""
    if isinstance(model_fingerprint, dict):
        from kmesh_host import ModelFingerprint

        return ModelFingerprint.from_dict(model_fingerprint)
    return model_fingerprint


def _check_fingerprint(key: str, seg: SourceSegment, model_fingerprint) -> None:
    """The check the segment store makes, for a store original served from the host tier."""
    want = seg.fingerprint
    if want is None:
        return
    if model_fingerprint is None:
        raise KmeshError(f"key {key!r}: reading the segment store needs the request's model_fingerprint")
    if model_fingerprint != want:
        diff = "; ".join(want.differences(model_fingerprint)) or "digest differs"
        raise FingerprintMismatch(f"segment {key}: saved by a different model ({diff})")


def check_segment(kv: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor | None) -> None:
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise LayoutError(f"kv: expected (2, L, T, H, D), got {tuple(kv.shape)}")
    T = kv.shape[2]
    if positions.dtype != torch.int64 or tuple(positions.shape) != (T,):
        raise LayoutError(f"positions: expected int64[T={T}], got {str(positions.dtype).removeprefix('torch.')}"
                          f"{list(positions.shape)}")
    if token_ids is not None and (token_ids.dtype != torch.int64 or tuple(token_ids.shape) != (T,)):
        raise LayoutError(f"token_ids: expected int64[T={T}], got {str(token_ids.dtype).removeprefix('torch.')}"
                          f"{list(token_ids.shape)}")


class SourceProvider(ABC):
    """Shared originals by key. Called by the cache service's request handlers (any thread).

    * ``get(key, *, model_fingerprint=None) -> SourceSegment`` — for every restore item; raises
      :class:`SegmentNotFound` (or an ``IntegrityError`` from a store) when it cannot supply it.
    * ``put(key, segment)`` — publishes an upload or a drained save; raises :class:`KmeshError`
      when the provider cannot take it (read-only, over budget).
    * ``delete(key) -> bool`` — called by ``evict`` after the registry confirmed no pending
      operation holds the key.
    * ``stats() -> dict`` — for ``status``.
    """

    @abstractmethod
    def get(self, key: str, *, model_fingerprint=None) -> SourceSegment: ...

    @abstractmethod
    def put(self, key: str, segment: SourceSegment) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def stats(self) -> dict: ...


class HostOriginals(SourceProvider):
    """The service's host-RAM tier of originals (immutable once put), in host RAM, up to ``budget_bytes``. ``pin``: page-lock them for async uploads."""

    def __init__(self, budget_bytes: int, *, pin: bool = False):
        self.budget_bytes = int(budget_bytes)
        self._pin = pin
        self._lock = threading.Lock()
        self._items: dict[str, SourceSegment] = {}
        self._bytes = 0

    def get(self, key: str, *, model_fingerprint=None) -> SourceSegment:
        with self._lock:
            seg = self._items.get(key)
        if seg is None:
            raise SegmentNotFound(f"key {key!r}: not in the host tier")
        return seg

    def get_many(self, keys) -> list[SourceSegment | None]:
        """The segments of ``keys`` looked up under one acquisition of the lock (``None``: absent)."""
        with self._lock:
            return [self._items.get(k) for k in keys]

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def put(self, key: str, segment: SourceSegment) -> None:
        check_segment(segment.kv, segment.positions, segment.token_ids)
        kv = segment.kv.contiguous()
        if kv.untyped_storage().nbytes() > kv.numel() * kv.element_size():
            kv = kv.clone()  # a view of a larger buffer (a store file's image): keep only what is charged
        if self._pin and not kv.is_pinned():
            kv = kv.pin_memory()
        segment = SourceSegment(kv, segment.positions.clone(),
                                None if segment.token_ids is None else segment.token_ids.clone(), segment.fingerprint)
        with self._lock:
            if key in self._items:
                raise KmeshError(f"key {key!r}: already present; originals are immutable (evict it first)")
            if self._bytes + segment.nbytes > self.budget_bytes:
                raise KmeshError(f"key {key!r}: {segment.nbytes} bytes exceed the host budget "
                                 f"({self._bytes} of {self.budget_bytes} used)")
            self._items[key] = segment
            self._bytes += segment.nbytes

    def delete(self, key: str) -> bool:
        with self._lock:
            seg = self._items.pop(key, None)
            if seg is not None:
                self._bytes -= seg.nbytes
            return seg is not None

    def stats(self) -> dict:
        with self._lock:
            return {"host_keys": len(self._items), "host_bytes": self._bytes, "host_budget_bytes": self.budget_bytes}


class StoreSource(SourceProvider):
    """Read-only adapter over ``kmesh_host.SegmentStore`` (Arrow segment files)."""

    def __init__(self, root: str):
        from kmesh_host import SegmentStore  # the store is optional for the service

        self.root = root
        self._store = SegmentStore(root)

    def get(self, key: str, *, model_fingerprint=None) -> SourceSegment:
        from kmesh_host import ModelFingerprint

        if model_fingerprint is None:
            if key not in self._store:  # absent: say so (SegmentNotFound), as without a store
                raise SegmentNotFound(f"key {key!r}: neither in the host tier nor in the segment store")
            raise KmeshError(f"key {key!r}: reading the segment store needs the request's model_fingerprint")
        if isinstance(model_fingerprint, dict):
            model_fingerprint = ModelFingerprint.from_dict(model_fingerprint)
        seg = self._store.get(key, model_fingerprint=model_fingerprint)
        token_ids = getattr(seg, "token_ids", None)
        return SourceSegment(seg.kv, torch.as_tensor(seg.positions, dtype=torch.int64),
                             None if token_ids is None else torch.as_tensor(token_ids, dtype=torch.int64),
                             getattr(seg, "fingerprint", None))

    def put(self, key: str, segment: SourceSegment) -> None:
        raise KmeshError("the segment store is read-only through the cache service; save with SegmentStore.put")

    def delete(self, key: str) -> bool:
        return False

    def stats(self) -> dict:
        return {"store_root": self.root}


class TieredSource(SourceProvider):
    """The host tier first, then the store; store hits are retained in the host tier when they fit."""

    def __init__(self, host: HostOriginals, store: SourceProvider | None = None):
        self.host = host
        self.store = store

    def get(self, key: str, *, model_fingerprint=None) -> SourceSegment:
        try:
            seg = self.host.get(key)
        except SegmentNotFound:
            if self.store is None:
                raise
        else:  # a store original retained here is checked as the store checks it
            if seg.fingerprint is not None:
                _check_fingerprint(key, seg, _model_fingerprint(model_fingerprint))
            return seg
        seg = self.store.get(key, model_fingerprint=model_fingerprint)
        try:
            self.host.put(key, seg)
            return self.host.get(key)
        except KmeshError:  # over budget or raced with another loader: serve the store's copy
            return seg

    def get_many(self, keys, *, model_fingerprint=None) -> list[SourceSegment]:
        """:meth:`get` for each key (a restore's items); host-tier hits need one lock acquisition."""
        segments = self.host.get_many(keys)
        wanted = None
        for i, seg in enumerate(segments):
            if seg is None:
                segments[i] = self.get(keys[i], model_fingerprint=model_fingerprint)
            elif seg.fingerprint is not None:
                if wanted is None:
                    wanted = _model_fingerprint(model_fingerprint)
                _check_fingerprint(keys[i], seg, wanted)
        return segments

    def put(self, key: str, segment: SourceSegment) -> None:
        self.host.put(key, segment)

    def delete(self, key: str) -> bool:
        return self.host.delete(key)

    def stats(self) -> dict:
        out = self.host.stats()
        if self.store is not None:
            out.update(self.store.stats())
        return out


@dataclass
class DeviceCopy:
    """A device copy of one host original. ``ready``: CUDA event after its upload (streams that read
    ``kv`` wait on it until the upload is known to have finished). ``source``: the host segment it
    was copied from. ``uploaded``: set once a query saw ``ready`` complete (it never un-completes:
    the event is recorded once)."""

    kv: torch.Tensor
    ready: object  # torch.cuda.Event
    source: SourceSegment
    uploaded: bool = False


class DeviceOriginals:
    """Device copies of shared originals, made on a restore's first use, up to ``budget_bytes`` per device.

    Called by the cache service's restore handler (any thread): ``get(key, segment, device)``
    returns the :class:`DeviceCopy` (uploading it on this tier's stream first if needed) or
    ``None`` when it cannot fit (the caller then uploads for the one request). ``drop(key)`` is
    called by ``evict`` once no pending operation holds the key, after the host tier has let the key
    go. An entry is valid only for the host segment object it was copied from, so a key evicted and
    published again is never served stale. Least recently used copies make room for new ones.

    ``is_current(key, segment)`` (optional): whether ``segment`` is still the original the service
    serves for ``key``; a copy is kept only while it is, checked under this tier's lock. A restore
    looks its segments up before it holds them, so an evict can run in between: without the check,
    that restore's first use would keep a device copy of a key already evicted (until least-recently-
    used pressure removed it), and a store segment served without a place in the host tier (a new
    object per request, never reused) would take budget from copies that are.

    Ownership: dropping an entry drops this tier's reference only. An operation that reads the copy
    holds it in its keepalive until its drain (physical completion), so the memory returns to
    torch's allocator only after every copy out of it has finished. ``stats()`` counts the bytes
    this tier holds.
    """

    def __init__(self, budget_bytes: int, *, is_current=None, on_drop=None):
        self.budget_bytes = int(budget_bytes)
        self._is_current = is_current
        #: ``on_drop(key)``: told of every copy this tier stops holding (the service's fast lanes
        #: then drop the rows that name it), after the tier's lock is released
        self._on_drop = on_drop
        self._dropped: list[str] = []
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, int], DeviceCopy] = OrderedDict()
        self._bytes: dict[int, int] = {}
        self._streams: dict[int, object] = {}

    def get(self, key: str, segment: SourceSegment, device: torch.device) -> DeviceCopy | None:
        try:
            return self._get(key, segment, device)
        finally:
            if self._dropped:
                self._tell_dropped()

    def _get(self, key: str, segment: SourceSegment, device: torch.device) -> DeviceCopy | None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        nbytes = segment.nbytes
        with self._lock:
            entry = self._entries.get((key, index))
            if entry is not None and entry.source is segment:
                self._entries.move_to_end((key, index))
                return entry
            if entry is not None:
                self._remove((key, index))
            if nbytes > self.budget_bytes:
                return None
            if self._is_current is not None and not self._is_current(key, segment):
                return None  # evicted (or never retained) since the caller looked it up: not kept
            for k in [k for k in self._entries if k[1] == index]:  # least recently used first
                if self._bytes.get(index, 0) + nbytes <= self.budget_bytes:
                    break
                self._remove(k)
            # Upload under the lock: concurrent first uses of one key upload it once. Submitting an
            # asynchronous copy from pinned memory takes microseconds; nobody waits for it here.
            kv, ready = self._upload(segment, index)
            entry = DeviceCopy(kv, ready, segment)
            self._entries[(key, index)] = entry
            self._bytes[index] = self._bytes.get(index, 0) + nbytes
            return entry

    def get_many(self, keys, segments, device: torch.device) -> list[DeviceCopy | None]:
        """:meth:`get` for each key (a restore's items): the copies already made are looked up
        under one acquisition of the lock; only missing or stale ones go through :meth:`get`."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        out = []
        with self._lock:
            entries = self._entries
            for key, segment in zip(keys, segments):
                entry = entries.get((key, index))
                if entry is not None and entry.source is segment:
                    entries.move_to_end((key, index))
                    out.append(entry)
                else:
                    out.append(None)
        for i, entry in enumerate(out):
            if entry is None:
                out[i] = self.get(keys[i], segments[i], device)
        return out

    def _upload(self, segment: SourceSegment, index: int):
        """Queue ``segment.kv``'s copy to device ``index`` on this tier's stream: (copy, its ready event)."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        with torch.cuda.device(index), torch.cuda.stream(stream):
            kv = segment.kv.to(torch.device("cuda", index), non_blocking=True)
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
        self._bytes[k[1]] -= entry.source.nbytes
        if self._on_drop is not None:
            self._dropped.append(k[0])

    def _tell_dropped(self) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for key in dropped:
            self._on_drop(key)

    def current(self, key: str, device: torch.device) -> DeviceCopy | None:
        """The copy of ``key`` this tier holds on ``device`` now (no upload, no reordering)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
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
