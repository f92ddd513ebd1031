"""The CacheBlend blender over the model runner and the restore contract (DESIGN.md §6, seed §24-25).

A child's prompt reuses saved segments at new positions. :meth:`Blender.blend`:

1. *restore*: one ``restorer.restore([RestoreItem(key, slots, new_positions), ...])`` places every
   segment into the child's own blocks, keys shifted to the new positions (the prompt's last
   position is never restored: its row is computed for the logits);
2. *layers* 0 .. L-1 over the prompt's rows ``0 .. T-2``: before the policy's first check layer every
   row is recomputed and its fresh K/V written; at a check layer the policy sees each candidate's
   fresh K/V and the restored K/V read from the cache *before* they are overwritten
   (:class:`~.selection.CheckView`) and keeps some; from there on only the kept rows and every row
   without restored data are computed, their K/V written into the cache, their queries attending over
   the whole prompt as the cache holds it (restored K/V where a row was not recomputed);
3. *decode*: the last prompt row and ``max_new_tokens`` greedy tokens (``Model.generate``).

Layers before the first check layer write the fresh K/V of every row. LMCache computes those
layers' attention over the fresh K/V too but leaves the restored K/V in vLLM's cache (its buffer
receives the recomputed rows only once ``imp_indices`` is set); the two differ only in what later
tokens read at those layers, by the shift's rounding at layer 0 (whose K/V do not depend on the
context). Writing the fresh ones makes ratio 1.0 equal full recomputation. From the check layer
on, the cache holds what LMCache's holds: restored K/V, the recomputed rows' fresh ones.

:meth:`Blender.blend_group` runs several children layer-major (every child finishes a layer before
any starts the next), each with its own rows, hidden states and blocks: ``exact`` runs each child's
math exactly as :meth:`blend` does (bit-identical results); ``batched`` restores all children in one
call and runs each layer's projections, MLP, selection and the decode steps on all children's rows
together (attention per child, over its own context).

Failures: a restore that raises, or any exception after the restore started (the policy, the model,
the ``on_layer`` hook), makes that child recompute its whole prompt without reuse into its own
blocks (``outcome.fallback`` says why); its siblings go on. The restorer guarantees that no copy is
in flight when it raises (:class:`~kmesh_host.restore.Restorer`). Bad input is refused
before any work (:class:`~.config.BlendError` naming the child and the field). The blender writes
only its children's slots; the restorer owns the saved originals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kmesh_host.restore import RestoreItem, Restorer
from kmesh_vllm.model import BlockTable, read_kv
from kmesh_vllm.workload import Workload

from .child import BlendChild, SavedSegment
from .config import BlendConfig, BlendError, ReuseFailed
from .outcome import BlendOutcome, RepairOutcome
from .selection import CheckView, selection_for

MODES = ("exact", "batched")
#: what the blender calls on its model: :class:`~kmesh_vllm.model.Model`'s row-wise steps (the vLLM
#: connector's adapter over vLLM's own modules provides the same)
_ROW_STEPS = ("embed", "qkv", "write_kv", "attend", "finish", "logits", "generate", "prefill")


@dataclass
class _Run:
    """One child's private state during a blend."""

    index: int
    child: BlendChild
    positions: torch.Tensor        # int64[n], n = T - 1: the blended rows' positions
    slots: torch.Tensor            # int64[n]
    prompt_slots: torch.Tensor     # int64[T]
    restored: torch.Tensor         # bool[n]
    seg_offset: torch.Tensor       # int64[n] (-1 where not restored)
    items: list
    restored_count: int = 0
    rows: torch.Tensor = None      # int64: the rows computed now (sorted positions)
    h: torch.Tensor = None
    check_index: int = 0
    choices: list = field(default_factory=list)
    fallback: str | None = None
    error: BaseException | None = None
    report: object = None
    timings: dict = field(default_factory=dict)
    generation: object = None

    @property
    def prompt_length(self) -> int:
        return self.prompt_slots.shape[0]

    def fail(self, stage: str, exc: BaseException) -> None:
        if self.fallback is None:
            self.fallback = f"{stage}: {type(exc).__name__}: {exc}"
            self.error = exc


class Blender:
    """CacheBlend over ``model`` and ``restorer`` (see the module docstring).

    Args:
        model: the :class:`~kmesh_vllm.model.Model`.
        restorer: a :class:`~kmesh_host.restore.Restorer` made for the paged cache the
            children's blocks live in (``restorer.cache``: one tensor; ``restorer.layout`` for this
            model) with the model's RoPE spec (``restorer.rope``) so that restored keys are shifted.
        config: the :class:`BlendConfig`.

    The blender owns no memory: the cache is the restorer's, each child's blocks are named by its
    table (the caller hands out disjoint blocks), the saved originals are the restorer's.
    """

    def __init__(self, model: Model, restorer: Restorer, config: BlendConfig = BlendConfig()):
        missing = [name for name in _ROW_STEPS if not callable(getattr(model, name, None))]
        if missing or not hasattr(model, "config") or not hasattr(model, "rope"):
            raise BlendError(f"model: expected a kmesh_vllm.model.Model (or an object with its row-wise steps "
                             f"{_ROW_STEPS}, config and rope), got {type(model).__name__} (missing {missing})")
        if not isinstance(restorer, Restorer):
            raise BlendError(f"restorer: expected a Restorer, got {type(restorer).__name__}")
        if not isinstance(config, BlendConfig):
            raise BlendError(f"config: expected a BlendConfig, got {type(config).__name__}")
        layout, c = restorer.layout, model.config
        want = (c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        got = (layout.num_layers, layout.num_kv_heads, layout.head_size, layout.dtype)
        if got != want:
            raise BlendError(f"restorer.layout: {layout.name} holds (layers, kv heads, head size, dtype) = {got}, "
                             f"the model needs {want}")
        if not isinstance(restorer.cache, torch.Tensor):
            raise BlendError(f"restorer.cache: expected one cache tensor, got {type(restorer.cache).__name__}")
        if restorer.rope != model.rope:
            raise BlendError(f"restorer.rope: expected the model's RoPE spec {model.rope} (restored keys must be "
                             f"shifted to the child's positions), got {restorer.rope}")
        self.model, self.restorer, self.config = model, restorer, config
        self.cache, self.layout = restorer.cache, layout
        self.selection = selection_for(config, model.num_layers)

    # ------------------------------------------------------------------ the leader
    def save_segments(self, workload: Workload, table: BlockTable) -> dict[str, SavedSegment]:
        """Compute and save ``workload``'s segments; returns name -> :class:`SavedSegment`.

        With a leader: its prompt is prefilled into ``table``'s blocks and each segment's slots are
        saved at the positions it has there. Without one: each segment is prefilled alone from
        position 0 (CacheBlend's setting) into ``table``'s first blocks and saved. ``table``'s blocks
        may be handed to children afterwards (the saved segments live in the restorer).
        """
        m = self.model
        workload.check(vocab_size=m.config.vocab_size, max_positions=m.rope.num_positions)
        leader = workload.leader_request()
        need = len(leader) if leader is not None else max(len(s) for s in workload.segments.values())
        self._check_table("leader", table, need)
        saved = {}
        if leader is not None:
            slots, positions = self._prefill(leader.token_ids, table)
            for span in leader.segments:
                if span.name in saved:
                    continue
                sl = slice(span.start, span.end)
                key = self.restorer.save(slots[sl], leader.token_ids[sl], positions[sl].cpu())
                saved[span.name] = SavedSegment(span.name, key, leader.token_ids[sl], positions[sl].cpu())
        else:
            for name in workload.segments:
                ids = workload.segment_ids(name)
                slots, positions = self._prefill(ids, table)
                key = self.restorer.save(slots, ids, positions.cpu())
                saved[name] = SavedSegment(name, key, ids, positions.cpu())
        return saved

    def _prefill(self, token_ids: torch.Tensor, table: BlockTable):
        slots, positions = table.context(token_ids.shape[0], self.model.device)
        self.model.prefill(token_ids, positions, self.cache, self.layout, slots.to(self.cache.device),
                           logits_rows=[-1])
        return slots.to(self.cache.device), positions

    def children(self, workload: Workload, saved: dict[str, SavedSegment], tables: Sequence[BlockTable]
                 ) -> list[BlendChild]:
        """``workload``'s children as :class:`BlendChild` objects, child ``i`` in ``tables[i]``."""
        requests = workload.requests()
        if len(tables) != len(requests):
            raise BlendError(f"tables: expected one per child ({len(requests)}), got {len(tables)}")
        return [BlendChild.from_request(r, saved, t) for r, t in zip(requests, tables)]

    # ------------------------------------------------------------------ checks (before any work)
    def _check_table(self, who: str, table: BlockTable, positions: int) -> None:
        layout = self.layout
        if not isinstance(table, BlockTable):
            raise BlendError(f"{who}: table: expected a BlockTable, got {type(table).__name__}")
        if table.block_size != layout.block_size:
            raise BlendError(f"{who}: table: blocks of {table.block_size} tokens, the cache's hold "
                             f"{layout.block_size}")
        if positions > table.capacity:
            raise BlendError(f"{who}: table: {positions} positions needed, the table holds {table.capacity}")
        used = table.block_ids[:-(-positions // table.block_size)]
        if used and max(used) >= layout.num_blocks:
            raise BlendError(f"{who}: table: block {max(used)} is outside the cache ({layout.num_blocks} blocks)")

    def _prepare(self, child: BlendChild, index: int) -> _Run:
        if not isinstance(child, BlendChild):
            raise BlendError(f"children[{index}]: expected a BlendChild, got {type(child).__name__}")
        m, who = self.model, f"child {child.name!r}"
        T = len(child)
        need = T + self.config.max_new_tokens - 1
        if need > m.rope.num_positions:
            raise BlendError(f"{who}: {T} prompt tokens and {self.config.max_new_tokens} generated need {need} "
                             f"positions, past the model's limit of {m.rope.num_positions}")
        ids = child.token_ids
        if int(ids.min()) < 0 or int(ids.max()) >= m.config.vocab_size:
            raise BlendError(f"{who}: token_ids: expected ids in [0, {m.config.vocab_size}), got range "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        self._check_table(who, child.table, need)
        n = T - 1
        restored = torch.zeros(n, dtype=torch.bool)
        seg_offset = torch.full((n,), -1, dtype=torch.int64)
        prompt_slots = child.table.slots(torch.arange(T))
        items, end = [], 0
        for u in child.segments:
            seg = u.segment
            if isinstance(u.start, bool) or not isinstance(u.start, int) or u.start < end:
                raise BlendError(f"{who}: segment {seg.name!r}: start {u.start!r} must be an int >= {end} (segments "
                                 "in prompt order, not overlapping)")
            if u.end > T:
                raise BlendError(f"{who}: segment {seg.name!r} at start {u.start}: its {len(seg)} tokens pass the "
                                 f"prompt's end ({T} tokens)")
            here = ids[u.start:u.end]
            if not torch.equal(here, seg.token_ids):
                p = u.start + int(torch.nonzero(here != seg.token_ids)[0])
                raise BlendError(f"{who}: segment {seg.name!r} at start {u.start}: the prompt's tokens differ from the "
                                 f"segment's (first at position {p}: {int(ids[p])} != "
                                 f"{int(seg.token_ids[p - u.start])})")
            end = u.end
            slots = prompt_slots[u.start:u.end].clone()
            if u.end == T:
                slots[-1] = -1  # the last prompt row is computed, never restored
            if not bool((slots >= 0).any()):
                continue
            items.append(RestoreItem(seg.key, slots, torch.arange(u.start, u.end)))
            last = u.end if u.end < T else T - 1
            restored[u.start:last] = True
            seg_offset[u.start:last] = torch.arange(last - u.start)
        dev = m.device
        positions = torch.arange(n, device=dev)
        return _Run(index, child, positions, prompt_slots[:n].to(self.cache.device), prompt_slots, restored.to(dev),
                    seg_offset.to(dev), items, int(restored.sum()))

    @staticmethod
    def _check_disjoint(runs: list[_Run]) -> None:
        owner = {}
        for r in runs:
            for b in r.child.table.block_ids:
                if b in owner:
                    raise BlendError(f"children: child {r.child.name!r} and child {owner[b]!r} share block {b} (each "
                                     "child writes only its own blocks)")
                owner[b] = r.child.name

    # ------------------------------------------------------------------ public entry points
    def blend(self, child: BlendChild, *, on_layer: Callable[[int, int], None] | None = None) -> BlendOutcome:
        """Blend one child (see the module docstring); ``on_layer(0, layer)`` is called after each of
        its layers (an exception there makes the child fall back)."""
        return self._blend([self._prepare(child, 0)], "exact", on_layer)[0]

    def blend_group(self, children: Sequence[BlendChild], *, mode: str = "exact",
                    on_layer: Callable[[int, int], None] | None = None) -> list[BlendOutcome]:
        """Blend ``children`` layer-major (``mode``: ``"exact"`` or ``"batched"``; see the module
        docstring). ``on_layer(child_index, layer)`` is called after each child's layer; an exception
        there makes that child fall back, the others go on. The children's blocks must be disjoint."""
        if mode not in MODES:
            raise BlendError(f"mode: expected one of {MODES}, got {mode!r}")
        runs = [self._prepare(c, i) for i, c in enumerate(children)]
        if not runs:
            raise BlendError("children: expected at least one child")
        self._check_disjoint(runs)
        return self._blend(runs, mode, on_layer)

    def repair(self, child: BlendChild, *, on_layer: Callable[[int, int], None] | None = None) -> RepairOutcome:
        """Restore and repair one child's prompt rows ``0 .. T-2`` in its blocks, and stop there: no
        decode and no fallback (for a caller that runs the rest itself, e.g. vLLM, which computes the
        last prompt row and decodes). Raises :class:`ReuseFailed` (its ``__cause__`` the error) when
        the restore or the repair failed: the child's blocks then hold unspecified K/V and must be
        recomputed by the caller (the restorer has drained its copies before it raised)."""
        run = self._prepare(child, 0)
        t0 = time.perf_counter()
        self._reuse([run], "exact", on_layer)
        run.timings["total_s"] = self._elapsed(t0)
        if run.fallback is not None:
            raise ReuseFailed(f"child {child.name!r}: {run.fallback}") from run.error
        restored = torch.cat([run.restored.cpu(), torch.zeros(1, dtype=torch.bool)])
        return RepairOutcome(child.name, run.choices, restored, run.timings, run.report)

    def full(self, child: BlendChild) -> BlendOutcome:
        """The reference: the whole prompt prefilled without reuse, then the same greedy decode."""
        run = self._prepare(child, 0)
        t0 = time.perf_counter()
        self._recompute(run)
        run.timings["recompute_s"] = run.timings["total_s"] = self._elapsed(t0)
        return self._outcome(run)

    # ------------------------------------------------------------------ the schedule
    def _blend(self, runs: list[_Run], mode: str, on_layer) -> list[BlendOutcome]:
        t0 = time.perf_counter()
        self._reuse(runs, mode, on_layer)
        self._decode(runs, mode)
        for r in runs:
            if r.fallback is not None:
                t = time.perf_counter()
                self._recompute(r)
                r.timings["recompute_s"] = self._elapsed(t)
        total = self._elapsed(t0)
        for r in runs:
            r.timings["total_s"] = total
        return [self._outcome(r) for r in runs]

    def _reuse(self, runs: list[_Run], mode: str, on_layer) -> None:
        """Restore every child and run the layer loop over its prompt rows (failures recorded in
        ``run.fallback``)."""
        if mode == "batched" and len(runs) > 1:
            self._restore_group(runs)
        else:
            for r in runs:
                self._restore(r)
        t_layers = time.perf_counter()
        for r in runs:
            if r.fallback is None:
                r.rows, r.h = r.positions, self.model.embed(r.child.token_ids[:-1])
                if not r.positions.numel():  # a one-token prompt: nothing to blend
                    r.choices = [r.positions for _ in range(self.model.num_layers)]
        for layer in range(self.model.num_layers):
            live = [r for r in runs if r.fallback is None and r.positions.numel()]
            if not live:
                break
            if mode == "batched" and len(live) > 1:
                try:
                    self._batched_step(live, layer)
                except Exception as exc:  # the group's rows were computed together: each recomputes alone
                    for r in live:
                        r.fail(f"layer {layer} (batched)", exc)
                    continue
                for r in live:
                    self._observe(on_layer, r, layer)
            else:
                for r in live:
                    try:
                        self._step(r, layer)
                    except Exception as exc:
                        r.fail(f"layer {layer}", exc)
                        continue
                    self._observe(on_layer, r, layer)
        layers_s = self._elapsed(t_layers)
        for r in runs:
            r.timings["layers_s"] = layers_s

    def _decode(self, runs: list[_Run], mode: str) -> None:
        if mode == "batched" and len(runs) > 1:
            live = [r for r in runs if r.fallback is None]
            t = time.perf_counter()
            try:
                self._decode_group(live)
            except Exception as exc:
                for r in live:
                    r.fail("decode (batched)", exc)
            decode_s = self._elapsed(t)
            for r in runs:
                r.timings["decode_s"] = decode_s
        else:
            for r in runs:
                if r.fallback is None:
                    t = time.perf_counter()
                    try:
                        r.generation = self._generate(r, prefilled=r.prompt_length - 1)
                    except Exception as exc:
                        r.fail("decode", exc)
                    r.timings["decode_s"] = self._elapsed(t)

    def _observe(self, on_layer, r: _Run, layer: int) -> None:
        if on_layer is None:
            return
        try:
            on_layer(r.index, layer)
        except Exception as exc:
            r.fail(f"on_layer({r.index}, {layer})", exc)

    def _elapsed(self, t0: float) -> float:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ restore
    def _restore(self, r: _Run) -> None:
        if not r.items:
            return
        t = time.perf_counter()
        try:
            r.report = self.restorer.restore(r.items).report
        except Exception as exc:
            r.fail("restore", exc)
        r.timings["restore_s"] = self._elapsed(t)

    def _restore_group(self, runs: list[_Run]) -> None:
        items = [it for r in runs for it in r.items]
        if not items:
            return
        t = time.perf_counter()
        try:
            report = self.restorer.restore(items).report
        except Exception:  # find whose restore fails: each child again alone (placement is idempotent)
            for r in runs:
                self._restore(r)
            return
        restore_s = self._elapsed(t)
        for r in runs:
            r.report = report
            r.timings["restore_s"] = restore_s

    # ------------------------------------------------------------------ one layer
    def _keep(self, r: _Run, chosen: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Indices into ``r.rows`` of the rows kept after a check layer (``chosen`` + every row
        without restored data); updates ``r.rows``."""
        if not isinstance(chosen, torch.Tensor) or chosen.dtype != torch.int64 or chosen.dim() != 1:
            raise BlendError(f"selection: expected int64[k] positions, got {chosen!r}")
        chosen = chosen.to(r.rows.device)
        if chosen.numel() and (torch.unique(chosen).numel() != chosen.numel()
                               or not bool(torch.isin(chosen, candidates).all())):
            raise BlendError("selection: the positions kept must be distinct candidates")
        keep = torch.sort(torch.cat([chosen, r.rows[~r.restored[r.rows]]])).values
        idx = torch.searchsorted(r.rows, keep)
        r.rows = keep
        return idx

    def _view(self, r: _Run, layer: int, k, v) -> CheckView:
        cand = r.restored[r.rows]
        positions = r.rows[cand]
        rk, rv = read_kv(self.cache, self.layout, layer, r.slots[positions])
        return CheckView(layer, r.check_index, positions, k[cand], v[cand], rk, rv, r.seg_offset[positions],
                         r.restored_count)

    def _step(self, r: _Run, layer: int) -> None:
        m = self.model
        q, k, v = m.qkv(layer, r.h, r.rows)
        if layer in self.selection.check_layers:
            view = self._view(r, layer, k, v)
            chosen = self.selection.select([view])[0]
            r.check_index += 1
            idx = self._keep(r, chosen, view.positions)
            q, k, v, r.h = q[idx], k[idx], v[idx], r.h[idx]
        m.write_kv(layer, k, v, self.cache, self.layout, r.slots[r.rows])
        a = m.attend(layer, q, r.rows, self.cache, self.layout, r.slots, r.positions)
        r.h = m.finish(layer, r.h, a)
        r.choices.append(r.rows)

    def _batched_step(self, runs: list[_Run], layer: int) -> None:
        m = self.model
        sizes = [r.rows.shape[0] for r in runs]
        h = torch.cat([r.h for r in runs])
        q, k, v = m.qkv(layer, h, torch.cat([r.rows for r in runs]))
        if layer in self.selection.check_layers:
            cands = [r.rows[r.restored[r.rows]] for r in runs]
            rk, rv = read_kv(self.cache, self.layout, layer, torch.cat([r.slots[c] for r, c in zip(runs, cands)]))
            counts = [c.shape[0] for c in cands]
            views, base = [], 0
            for r, ki, vi, rki, rvi in zip(runs, k.split(sizes), v.split(sizes), rk.split(counts), rv.split(counts)):
                cand = r.restored[r.rows]
                views.append(CheckView(layer, r.check_index, r.rows[cand], ki[cand], vi[cand], rki, rvi,
                                       r.seg_offset[r.rows[cand]], r.restored_count))
            chosen = self.selection.select(views)
            idx, base = [], 0
            for r, size, c, view in zip(runs, sizes, chosen, views):
                r.check_index += 1
                idx.append(base + self._keep(r, c, view.positions))
                base += size
            idx = torch.cat(idx)
            q, k, v, h = q[idx], k[idx], v[idx], h[idx]
            sizes = [r.rows.shape[0] for r in runs]
        m.write_kv(layer, k, v, self.cache, self.layout, torch.cat([r.slots[r.rows] for r in runs]))
        a = torch.cat([m.attend(layer, qi, r.rows, self.cache, self.layout, r.slots, r.positions)
                       for r, qi in zip(runs, q.split(sizes))])
        h = m.finish(layer, h, a)
        for r, hi in zip(runs, h.split(sizes)):
            r.h = hi
            r.choices.append(r.rows)

    # ------------------------------------------------------------------ decode and fallback
    def _generate(self, r: _Run, *, prefilled: int):
        return self.model.generate(r.child.token_ids, r.child.table, self.cache, self.layout,
                                   max_new_tokens=self.config.max_new_tokens, prefilled=prefilled)

    def _decode_group(self, runs: list[_Run]) -> None:
        """Greedy decoding of ``runs`` together: each step's rows (one per child) through every layer
        at once, attention per child. Equal to ``Model.generate`` per child up to row batching."""
        if not runs:
            return
        m = self.model
        eos = set(m.config.eos_token_ids)
        feed = {r.index: (int(r.child.token_ids[-1]), r.prompt_length - 1) for r in runs}
        out = {r.index: ([], []) for r in runs}
        active = list(runs)
        for step in range(self.config.max_new_tokens):
            ids = torch.tensor([feed[r.index][0] for r in active], device=m.device)
            pos = torch.tensor([feed[r.index][1] for r in active], device=m.device)
            ctx = [r.child.table.context(feed[r.index][1] + 1, m.device) for r in active]
            slots = torch.cat([c[0][-1:] for c in ctx]).to(self.cache.device)
            h = m.embed(ids)
            for layer in range(m.num_layers):
                q, k, v = m.qkv(layer, h, pos)
                m.write_kv(layer, k, v, self.cache, self.layout, slots)
                a = torch.cat([m.attend(layer, q[i:i + 1], pos[i:i + 1], self.cache, self.layout,
                                        c[0].to(self.cache.device), c[1]) for i, c in enumerate(ctx)])
                h = m.finish(layer, h, a)
            logits = m.logits(h)
            nxt = []
            for i, r in enumerate(active):
                token = int(torch.argmax(logits[i]))
                out[r.index][0].append(token)
                out[r.index][1].append(logits[i])
                if token not in eos and step < self.config.max_new_tokens - 1:
                    feed[r.index] = (token, feed[r.index][1] + 1)
                    nxt.append(r)
            active = nxt
            if not active:
                break
        for r in runs:
            tokens, steps = out[r.index]
            r.generation = _Generated(tokens, torch.stack(steps))

    def _recompute(self, r: _Run) -> None:
        """The child's whole prompt and decode without reuse, into its own blocks (a fallback, or
        :meth:`full`)."""
        r.generation = self._generate(r, prefilled=0)
        r.choices = [r.positions for _ in range(self.model.num_layers)]
        r.restored = torch.zeros_like(r.restored)

    def _outcome(self, r: _Run) -> BlendOutcome:
        g = r.generation
        restored = torch.cat([r.restored.cpu(), torch.zeros(1, dtype=torch.bool)])
        return BlendOutcome(r.child.name, list(g.token_ids), g.logits[0], g.logits, r.choices, restored,
                            r.prompt_slots, r.child.table, r.prompt_length, self.cache, self.layout, r.timings,
                            r.fallback, r.report)


@dataclass(frozen=True)
class _Generated:
    token_ids: list
    logits: torch.Tensor


