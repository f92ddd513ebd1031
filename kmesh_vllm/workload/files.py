"""Workload files (``kmesh demo --workload FILE.json``)::

    {"segments": {name: piece, ...},
     "leader": {"parts": [part, ...]},                     (optional)
     "children": [{"name": str, "parts": [part, ...], "answer": str, "about": name}, ...]}

A part is a piece or ``{"segment": name}``; a piece is a list of token ids or, when the model has a
tokenizer, a string (tokenised on its own: a segment's ids never depend on its neighbours).
``answer`` (the known short answer) and ``about`` (the segment the question asks about) are
optional. Unknown keys are refused. Every error names the field: ``children[2].parts[1].segment:
unknown segment 'x'``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from .spec import ChildSpec, SegmentRef, Workload, WorkloadError


def _piece(value, tokenizer, where: str):
    if isinstance(value, str):
        if tokenizer is None:
            raise WorkloadError(f"{where}: a string piece needs a tokenizer (the model has none); give token ids")
        ids = tokenizer.encode(value, add_special_tokens=False).ids
        if not ids:
            raise WorkloadError(f"{where}: the string {value!r} has no tokens")
        return list(ids)
    if isinstance(value, list):
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise WorkloadError(f"{where}[{i}]: expected a token id (an int >= 0), got {t!r}")
        return value
    raise WorkloadError(f"{where}: expected a string or a list of token ids, got {type(value).__name__}")


def _keys(d, allowed: set, required: set, where: str) -> None:
    if not isinstance(d, Mapping):
        raise WorkloadError(f"{where}: expected an object, got {type(d).__name__}")
    extra = sorted(set(d) - allowed)
    if extra:
        raise WorkloadError(f"{where}: unknown field {extra[0]!r} (expected {sorted(allowed)})")
    missing = sorted(required - set(d))
    if missing:
        raise WorkloadError(f"{where}.{missing[0]}: missing")


def _parts(value, tokenizer, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise WorkloadError(f"{where}: expected a non-empty list of parts")
    out = []
    for j, p in enumerate(value):
        if isinstance(p, Mapping):
            _keys(p, {"segment"}, {"segment"}, f"{where}[{j}]")
            if not isinstance(p["segment"], str):
                raise WorkloadError(f"{where}[{j}].segment: expected a segment name, got {p['segment']!r}")
            out.append(SegmentRef(p["segment"]))
        else:
            piece = _piece(p, tokenizer, f"{where}[{j}]")
            if not piece:
                raise WorkloadError(f"{where}[{j}]: an empty piece")
            out.append(piece)
    return out


def parse_workload(data, tokenizer=None) -> Workload:
    """A :class:`Workload` from the decoded JSON of a workload file (``tokenizer``: a
    ``tokenizers.Tokenizer`` for string pieces, or None)."""
    _keys(data, {"segments", "leader", "children"}, {"segments", "children"}, "workload")
    segments = data["segments"]
    if not isinstance(segments, Mapping) or not segments:
        raise WorkloadError("segments: expected an object of named segments (at least one)")
    segs = {}
    for name, piece in segments.items():
        ids = _piece(piece, tokenizer, f"segments.{name}")
        if not ids:
            raise WorkloadError(f"segments.{name}: a segment needs at least one token")
        segs[name] = ids
    leader = None
    if "leader" in data and data["leader"] is not None:
        _keys(data["leader"], {"parts"}, {"parts"}, "leader")
        leader = _parts(data["leader"]["parts"], tokenizer, "leader.parts")
    children = data["children"]
    if not isinstance(children, list) or not children:
        raise WorkloadError("children: expected a non-empty list of children")
    specs = []
    for i, c in enumerate(children):
        where = f"children[{i}]"
        _keys(c, {"name", "parts", "answer", "about"}, {"name", "parts"}, where)
        if not isinstance(c["name"], str) or not c["name"]:
            raise WorkloadError(f"{where}.name: expected a non-empty string, got {c['name']!r}")
        answer, about = c.get("answer"), c.get("about")
        if answer is not None and not isinstance(answer, str):
            raise WorkloadError(f"{where}.answer: expected a string, got {type(answer).__name__}")
        if about is not None and not isinstance(about, str):
            raise WorkloadError(f"{where}.about: expected a segment name, got {about!r}")
        specs.append(ChildSpec(c["name"], tuple(_parts(c["parts"], tokenizer, f"{where}.parts")), answer, about))
    return Workload(segs, leader, tuple(specs))


def load_workload(path, tokenizer=None) -> Workload:
    """Read a workload file (see the module docstring). ``tokenizer`` tokenises string pieces."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise WorkloadError(f"workload: cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"workload: {path} is not JSON: {exc}") from exc
    return parse_workload(data, tokenizer)


def save_workload(workload: Workload, path) -> Path:
    """Write ``workload`` as a workload file (pieces as token ids)."""
    path = Path(path)
    path.write_text(json.dumps(workload.to_json()))
    return path
