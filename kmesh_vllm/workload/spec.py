"""A reuse workload: shared segments, an optional leader, children (DESIGN.md §6, seed §24).

A request's prompt is a list of *parts*; a part is a piece of text (token ids) or a reference to a
named shared segment. The request's tokens are its parts' tokens in order, each segment contributing
exactly its own token ids, so a segment's ids are the same in the leader and in every child and no
boundary is ever re-tokenised. Where each segment sits in a request (:class:`SegmentSpan`) follows
from the parts; it is never found by searching the prompt.

Without a leader, each segment is prefilled alone from position 0 (CacheBlend's setting); with one,
the segments are saved from the leader's prompt, at the positions they have there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kmesh_gpu.errors import KmeshError


class WorkloadError(KmeshError, ValueError):
    """A workload (file or arguments) that does not describe requests; the message names the field."""


@dataclass(frozen=True)
class SegmentRef:
    """A part that stands for the named shared segment."""

    name: str


@dataclass(frozen=True)
class SegmentSpan:
    """Where a segment sits in a request: positions ``start .. start + length - 1``."""

    name: str
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    Attributes:
        name: the request's name (``"leader"`` for the leader).
        token_ids: ``int64[T]`` on the CPU: the prompt.
        segments: the shared segments in the prompt, in prompt order (derived from the parts).
        answer: the known short answer (a string), or None.
        about: the segment the question asks about, or None.
    """

    name: str
    token_ids: torch.Tensor
    segments: tuple[SegmentSpan, ...]
    answer: str | None = None
    about: str | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class ChildSpec:
    """A child as the workload states it: ``parts`` (tuples of token ids or :class:`SegmentRef`)."""

    name: str
    parts: tuple
    answer: str | None = None
    about: str | None = None


def _ids(piece, where: str) -> tuple[int, ...]:
    if isinstance(piece, torch.Tensor):
        piece = piece.tolist()
    if isinstance(piece, (str, bytes)) or not isinstance(piece, Sequence):
        raise WorkloadError(f"{where}: expected a list of token ids, got {type(piece).__name__}")
    out = []
    for i, t in enumerate(piece):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise WorkloadError(f"{where}[{i}]: expected a token id (an int >= 0), got {t!r}")
        out.append(int(t))
    return tuple(out)


@dataclass(frozen=True)
class Workload:
    """Shared segments, an optional leader and the children that reuse the segments.

    Attributes:
        segments: name -> the segment's token ids (a non-empty tuple of ints).
        leader: the leader's parts, or None (then each segment is prefilled alone from position 0).
        children: the children, at least one, names unique.

    The constructor checks the structure; errors name the field (``children[2].parts[1].segment:
    unknown segment 'x'``). Token ids are checked against a vocabulary by :meth:`check_vocab`.
    """

    segments: Mapping[str, tuple[int, ...]]
    leader: tuple | None
    children: tuple[ChildSpec, ...]

    def __post_init__(self):
        if not isinstance(self.segments, Mapping) or not self.segments:
            raise WorkloadError("segments: expected at least one named segment")
        segs = {}
        for name, ids in self.segments.items():
            if not isinstance(name, str) or not name:
                raise WorkloadError(f"segments: expected non-empty string names, got {name!r}")
            ids = _ids(ids, f"segments.{name}")
            if not ids:
                raise WorkloadError(f"segments.{name}: a segment needs at least one token")
            segs[name] = ids
        object.__setattr__(self, "segments", segs)
        if self.leader is not None:
            object.__setattr__(self, "leader", self._parts(self.leader, "leader.parts"))
            used = {p.name for p in self.leader if isinstance(p, SegmentRef)}
            missing = [n for n in segs if n not in used]
            if missing:
                raise WorkloadError(f"leader.parts: the leader must hold every segment; it lacks {missing}")
        if isinstance(self.children, (str, bytes)) or not isinstance(self.children, Sequence) or not self.children:
            raise WorkloadError("children: expected at least one child")
        children, names = [], set()
        for i, c in enumerate(self.children):
            if not isinstance(c, ChildSpec):
                raise WorkloadError(f"children[{i}]: expected a ChildSpec, got {type(c).__name__}")
            if not isinstance(c.name, str) or not c.name:
                raise WorkloadError(f"children[{i}].name: expected a non-empty string, got {c.name!r}")
            if c.name in names:
                raise WorkloadError(f"children[{i}].name: {c.name!r} is used twice")
            names.add(c.name)
            if c.answer is not None and not isinstance(c.answer, str):
                raise WorkloadError(f"children[{i}].answer: expected a string, got {type(c.answer).__name__}")
            if c.about is not None and c.about not in segs:
                raise WorkloadError(f"children[{i}].about: unknown segment {c.about!r}")
            children.append(ChildSpec(c.name, self._parts(c.parts, f"children[{i}].parts"), c.answer, c.about))
        object.__setattr__(self, "children", tuple(children))

    def _parts(self, parts, where: str) -> tuple:
        if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
            raise WorkloadError(f"{where}: expected a non-empty list of parts")
        out = []
        for j, p in enumerate(parts):
            if isinstance(p, SegmentRef):
                if p.name not in self.segments:
                    raise WorkloadError(f"{where}[{j}].segment: unknown segment {p.name!r}")
                out.append(p)
            else:
                out.append(_ids(p, f"{where}[{j}]"))
        return tuple(out)

    # ------------------------------------------------------------------ requests
    def _request(self, name: str, parts: tuple, answer=None, about=None) -> Request:
        ids, spans, pos = [], [], 0
        for p in parts:
            if isinstance(p, SegmentRef):
                seg = self.segments[p.name]
                spans.append(SegmentSpan(p.name, pos, len(seg)))
                ids.extend(seg)
                pos += len(seg)
            else:
                ids.extend(p)
                pos += len(p)
        return Request(name, torch.tensor(ids, dtype=torch.int64), tuple(spans), answer, about)

    def leader_request(self) -> Request | None:
        """The leader's :class:`Request`, or None without a leader."""
        return None if self.leader is None else self._request("leader", self.leader)

    def requests(self) -> list[Request]:
        """The children's :class:`Request` objects, in order."""
        return [self._request(c.name, c.parts, c.answer, c.about) for c in self.children]

    def segment_ids(self, name: str) -> torch.Tensor:
        """``int64[n]``: segment ``name``'s token ids."""
        return torch.tensor(self.segments[name], dtype=torch.int64)

    @property
    def shared_tokens(self) -> int:
        return sum(len(s) for s in self.segments.values())

    def check(self, *, vocab_size: int, max_positions: int, max_new_tokens: int = 1) -> None:
        """Every token id below ``vocab_size``; every request (with ``max_new_tokens`` generated after
        a child's prompt) within ``max_positions``. Raises :class:`WorkloadError` naming the field."""
        for name, ids in self.segments.items():
            self._vocab(ids, vocab_size, f"segments.{name}")
        groups = ([("leader.parts", self.leader, 0)] if self.leader is not None else []) + \
                 [(f"children[{i}].parts", c.parts, max_new_tokens - 1) for i, c in enumerate(self.children)]
        for where, parts, extra in groups:
            total = 0
            for j, p in enumerate(parts):
                if not isinstance(p, SegmentRef):
                    self._vocab(p, vocab_size, f"{where}[{j}]")
                    total += len(p)
                else:
                    total += len(self.segments[p.name])
            if total + extra > max_positions:
                raise WorkloadError(f"{where}: {total} prompt tokens (+{extra} generated) pass the model's limit of "
                                    f"{max_positions} positions")
        if self.leader is None:
            for name, ids in self.segments.items():
                if len(ids) > max_positions:
                    raise WorkloadError(f"segments.{name}: {len(ids)} tokens pass the model's limit of "
                                        f"{max_positions} positions")

    @staticmethod
    def _vocab(ids, vocab_size: int, where: str) -> None:
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise WorkloadError(f"{where}: token id {bad[0]} is outside the model's vocabulary (size {vocab_size})")

    def to_json(self) -> dict:
        """The workload-file form (every piece as token ids): ``load_workload`` reads it back."""
        def parts(ps):
            return [{"segment": p.name} if isinstance(p, SegmentRef) else list(p) for p in ps]

        out = {"segments": {n: list(ids) for n, ids in self.segments.items()}}
        if self.leader is not None:
            out["leader"] = {"parts": parts(self.leader)}
        out["children"] = []
        for c in self.children:
            d = {"name": c.name, "parts": parts(c.parts)}
            if c.answer is not None:
                d["answer"] = c.answer
            if c.about is not None:
                d["about"] = c.about
            out["children"].append(d)
        return out
