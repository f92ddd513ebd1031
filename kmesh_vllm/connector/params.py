"""A request's KMesh instructions: ``kv_transfer_params["kmesh"]``, parsed and checked against its prompt.

* a leader: ``{"kmesh": {"save": [{"name", "start", "length"}, ...]}}`` saves those prompt ranges
  as segments once the prompt is computed; ``{"kmesh": {"save": "all", "name"?}}`` saves the
  whole prompt as one segment. A name is optional (the key is always returned).
* a child: ``{"kmesh": {"segments": [{"name": ..., "start": p} | {"key": ..., "start": p}, ...],
  "recompute_ratio"?: r}}`` reuses saved segments at prompt positions ``p ..``.

A request without a ``"kmesh"`` entry is not the connector's business (:func:`parse_request`
returns None). Anything malformed is a :class:`ConnectorError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .config import ConnectorError

_KEY_CHARS = set("0123456789abcdef")
_ROOT = "kv_transfer_params.kmesh"


@dataclass(frozen=True)
class SaveRange:
    """Prompt positions ``start .. start + length - 1`` of a leader, saved as one segment."""

    name: str | None
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class LeaderParams:
    ranges: tuple[SaveRange, ...]


@dataclass(frozen=True)
class SegmentRef:
    """A saved segment a child places at prompt position ``start``: by ``name`` (in the
    connector's namespace) or by ``key``."""

    name: str | None
    key: str | None
    start: int

    @property
    def label(self) -> str:
        return f"name {self.name!r}" if self.name is not None else f"key {self.key}"


@dataclass(frozen=True)
class ChildParams:
    segments: tuple[SegmentRef, ...]
    recompute_ratio: float | None


def _int(field: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConnectorError(f"{field}: expected an int >= {lo}, got {v!r}")
    return v


def _name(field: str, v) -> str:
    if not isinstance(v, str) or not v or len(v) > 512:
        raise ConnectorError(f"{field}: expected a non-empty string of at most 512 characters, got {v!r}")
    return v


def _only(field: str, d: Mapping, allowed: tuple[str, ...]) -> None:
    extra = sorted(set(d) - set(allowed))
    if extra:
        raise ConnectorError(f"{field}.{extra[0]}: unknown field; expected some of {list(allowed)}")


def parse_request(kv_transfer_params, prompt_length: int) -> LeaderParams | ChildParams | None:
    """The ``"kmesh"`` entry of a request's ``kv_transfer_params`` (None when there is none),
    checked against its ``prompt_length`` tokens."""
    if kv_transfer_params is None:
        return None
    if not isinstance(kv_transfer_params, Mapping):
        raise ConnectorError(f"kv_transfer_params: expected an object, got {type(kv_transfer_params).__name__}")
    if "kmesh" not in kv_transfer_params:
        return None
    p = kv_transfer_params["kmesh"]
    if not isinstance(p, Mapping):
        raise ConnectorError(f"{_ROOT}: expected an object, got {p!r}")
    if ("save" in p) == ("segments" in p):
        raise ConnectorError(f"{_ROOT}: expected exactly one of 'save' (a leader) and 'segments' (a child), got "
                             f"{sorted(p)}")
    if "save" in p:
        return _leader(p, prompt_length)
    return _child(p, prompt_length)


def _leader(p: Mapping, prompt_length: int) -> LeaderParams:
    save = p["save"]
    if save == "all":
        _only(_ROOT, p, ("save", "name"))
        name = _name(f"{_ROOT}.name", p["name"]) if "name" in p else None
        return LeaderParams((SaveRange(name, 0, prompt_length),))
    _only(_ROOT, p, ("save",))
    if isinstance(save, (str, bytes, Mapping)) or not isinstance(save, (list, tuple)) or not save:
        raise ConnectorError(f"{_ROOT}.save: expected \"all\" or a non-empty list of {{name, start, length}}, "
                             f"got {save!r}")
    ranges, names = [], set()
    for i, r in enumerate(save):
        field = f"{_ROOT}.save[{i}]"
        if not isinstance(r, Mapping):
            raise ConnectorError(f"{field}: expected an object {{name, start, length}}, got {r!r}")
        _only(field, r, ("name", "start", "length"))
        for need in ("start", "length"):
            if need not in r:
                raise ConnectorError(f"{field}.{need}: missing")
        name = _name(f"{field}.name", r["name"]) if r.get("name") is not None else None
        start, length = _int(f"{field}.start", r["start"], 0), _int(f"{field}.length", r["length"], 1)
        if start + length > prompt_length:
            raise ConnectorError(f"{field}: positions {start} .. {start + length - 1} pass the prompt's end "
                                 f"({prompt_length} tokens)")
        if name is not None and name in names:
            raise ConnectorError(f"{field}.name: {name!r} is saved twice by this request")
        names.add(name)
        ranges.append(SaveRange(name, start, length))
    return LeaderParams(tuple(ranges))


def _child(p: Mapping, prompt_length: int) -> ChildParams:
    _only(_ROOT, p, ("segments", "recompute_ratio"))
    segs = p["segments"]
    if isinstance(segs, (str, bytes, Mapping)) or not isinstance(segs, (list, tuple)) or not segs:
        raise ConnectorError(f"{_ROOT}.segments: expected a non-empty list of {{name or key, start}}, got {segs!r}")
    refs = []
    for i, s in enumerate(segs):
        field = f"{_ROOT}.segments[{i}]"
        if not isinstance(s, Mapping):
            raise ConnectorError(f"{field}: expected an object {{name or key, start}}, got {s!r}")
        _only(field, s, ("name", "key", "start"))
        if ("name" in s) == ("key" in s):
            raise ConnectorError(f"{field}: expected exactly one of 'name' and 'key', got {sorted(s)}")
        if "start" not in s:
            raise ConnectorError(f"{field}.start: missing")
        key = s.get("key")
        if key is not None and (not isinstance(key, str) or len(key) != 64 or not set(key) <= _KEY_CHARS):
            raise ConnectorError(f"{field}.key: expected a segment key (64 lowercase hex digits), got {key!r}")
        name = _name(f"{field}.name", s["name"]) if "name" in s else None
        start = _int(f"{field}.start", s["start"], 0)
        if start >= prompt_length:
            raise ConnectorError(f"{field}.start: {start} is past the prompt's last position ({prompt_length - 1})")
        refs.append(SegmentRef(name, key, start))
    ratio = p.get("recompute_ratio")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not math.isfinite(ratio) or not 0 <= ratio <= 1):
        raise ConnectorError(f"{_ROOT}.recompute_ratio: expected a number in [0, 1], got {ratio!r}")
    return ChildParams(tuple(refs), None if ratio is None else float(ratio))
