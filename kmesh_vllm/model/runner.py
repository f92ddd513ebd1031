"""A layer-by-layer decoder over a paged KV cache in any :class:`kmesh_gpu.KVLayout`.

The steps of one layer are public so that a caller (the blender) can run them on any rows, stop
after any layer and change the cache in between::

    h = model.embed(token_ids)                                  # [S, E]
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, h, positions)                # RoPE applied to q and k
        model.write_kv(layer, k, v, cache, layout, slots)       # vLLM's slot mapping; -1 skips
        a = model.attend(layer, q, positions, cache, layout, context_slots, context_positions)
        h = model.finish(layer, h, a)                           # o_proj, residual, MLP, residual
    logits = model.logits(h)

``embed``, ``qkv``, ``finish`` and ``logits`` are row-wise: rows of several requests may be
concatenated. ``attend`` reads one context (one request's block table) for all its rows. The math
follows the HF reference of these families (RMSNorm in fp32, SwiGLU MLP, fp32 softmax). The same
inputs give the same bits; a row computed among other rows (another matrix shape) may differ from
the same row computed alone in its last bits, so paths compared bit for bit must batch rows alike.
The model's dtype is fp32 by default (bf16 and fp16 work); the code is device-generic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kmesh_gpu import KVLayout, LayoutError

from .attention import context_attention
from .config import ModelConfig
from .errors import ModelError
from .paged import BlockTable, check_slots, check_write_slots, flat_cache, read_flat, write_flat, write_kv
from .weights import Weights


def _fmt(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, round to the input dtype, then scale by ``weight``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(frozen=True)
class Generation:
    """What :meth:`Model.generate` produced: the new token ids and, per new token, the fp32 logits
    ``[n, vocab]`` it was chosen from (greedy)."""

    token_ids: list[int]
    logits: torch.Tensor


class Model:
    """A decoder model with its weights on one device in one dtype.

    Attributes:
        config: the :class:`ModelConfig`.
        tokenizer: a ``tokenizers.Tokenizer`` or None; chat_template: the Jinja template or None.
        rope: the :class:`kmesh_gpu.RopeSpec` the keys are rotated with (in the model dtype).
        fingerprint: the :class:`kmesh_host.ModelFingerprint` segments of this model carry.
        dtype, device, num_layers, name.
    """

    def __init__(self, config: ModelConfig, weights: Weights, *, dtype: torch.dtype, device,
                 tokenizer=None, chat_template: str | None = None, name: str = "model"):
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.name = name
        self.rope = config.rope_spec(dtype)
        self.fingerprint = config.fingerprint(dtype)
        self.num_layers = config.num_layers
        self._max_positions = self.rope.num_positions

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.name!r}, {c.architecture}, layers={c.num_layers}, hidden={c.hidden_size}, "
                f"heads={c.num_heads}/{c.num_kv_heads}x{c.head_dim}, {str(self.dtype).removeprefix('torch.')} "
                f"on {self.device})")

    def kv_layout(self, num_blocks: int, block_size: int = 16, name: str = "LBHNC",
                  kv_packing: str = "content") -> KVLayout:
        """A vLLM-named paged cache layout for this model (its layers, KV heads, head size, dtype)."""
        c = self.config
        return KVLayout.from_vllm(name, num_layers=c.num_layers, num_blocks=num_blocks, block_size=block_size,
                                  num_kv_heads=c.num_kv_heads, head_size=c.head_dim, dtype=self.dtype,
                                  kv_packing=kv_packing)

    # ------------------------------------------------------------------ argument checks
    def _rows(self, name: str, t, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """``t`` checked as ``dtype[shape]`` (None: any size); index tensors (int64) are moved to the
        model's device, float tensors must already be there."""
        if (not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != len(shape)
                or any(s is not None and s != n for s, n in zip(shape, t.shape))
                or (dtype != torch.int64 and t.device != self.device)):
            want = ", ".join("S" if s is None else str(s) for s in shape)
            raise ModelError(f"{name}: expected {str(dtype).removeprefix('torch.')}[{want}] on {self.device}, "
                             f"got {_fmt(t)}")
        return t.to(self.device)

    def _hidden(self, name: str, t, width: int, rows: int | None = None) -> torch.Tensor:
        return self._rows(name, t, self.dtype, (rows, width))

    def _positions(self, name: str, positions, count: int | None) -> torch.Tensor:
        positions = self._rows(name, positions, torch.int64, (count,))
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self._max_positions):
            raise ModelError(f"{name}: positions must lie in [0, {self._max_positions}) (the model's RoPE "
                             f"positions), got range [{int(positions.min())}, {int(positions.max())}]")
        return positions

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ModelError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def _cache(self, cache, layout) -> torch.Tensor:
        if not isinstance(layout, KVLayout):
            raise LayoutError(f"layout: expected a KVLayout, got {type(layout).__name__}")
        c = self.config
        want = (c.num_layers, c.num_kv_heads, c.head_dim, self.dtype)
        got = (layout.num_layers, layout.num_kv_heads, layout.head_size, layout.dtype)
        if got != want:
            raise LayoutError(f"layout: {layout.name} holds (layers, kv heads, head size, dtype) = {got}, "
                              f"the model needs {want}")
        if isinstance(cache, torch.Tensor) and cache.device != self.device:
            raise LayoutError(f"cache: on {cache.device}, the model is on {self.device}")
        return flat_cache(cache, layout)

    def _kv(self, k, v) -> None:
        c = self.config
        self._rows("k", k, self.dtype, (None, c.num_kv_heads, c.head_dim))
        self._rows("v", v, self.dtype, (k.shape[0], c.num_kv_heads, c.head_dim))

    # ------------------------------------------------------------------ the steps of a layer
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids`` int64[S] (each in ``[0, vocab)``) -> hidden ``[S, E]`` in the model dtype."""
        token_ids = self._token_ids(token_ids)
        return F.embedding(token_ids, self.weights.embed)

    def _token_ids(self, token_ids) -> torch.Tensor:
        token_ids = self._rows("token_ids", token_ids, torch.int64, (None,))
        V = self.config.vocab_size
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= V):
            raise ModelError(f"token_ids: expected ids in [0, {V}), got range "
                             f"[{int(token_ids.min())}, {int(token_ids.max())}]")
        return token_ids

    def qkv(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input norm and q/k/v projections of ``layer`` for rows ``hidden`` ``[S, E]`` at ``positions``
        (int64[S]): ``q [S, Hq, D]``, ``k [S, Hkv, D]``, ``v [S, Hkv, D]`` in the model dtype, q and k
        rotated by :meth:`RopeSpec.apply` (after Qwen3's per-head norm)."""
        layer = self._layer(layer)
        hidden = self._hidden("hidden", hidden, self.config.hidden_size)
        positions = self._positions("positions", positions, hidden.shape[0])
        return self._qkv(layer, hidden, positions)

    def _qkv(self, layer, hidden, positions):
        c, w = self.config, self.weights.layers[layer]
        x = rms_norm(hidden, w.input_norm, c.rms_norm_eps)
        S = x.shape[0]
        q = F.linear(x, w.q, w.q_bias).view(S, c.num_heads, c.head_dim)
        k = F.linear(x, w.k, w.k_bias).view(S, c.num_kv_heads, c.head_dim)
        v = F.linear(x, w.v, w.v_bias).view(S, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, w.q_norm, c.rms_norm_eps)
            k = rms_norm(k, w.k_norm, c.rms_norm_eps)
        return self.rope.apply(q, positions), self.rope.apply(k, positions), v

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, layout: KVLayout,
                 slots: torch.Tensor) -> None:
        """Write ``k``, ``v`` ``[S, Hkv, D]`` of ``layer`` into ``cache`` at ``slots`` (int64[S]; -1 skips a
        row; the others distinct and in ``[0, layout.num_slots)``)."""
        layer = self._layer(layer)
        self._cache(cache, layout)
        self._kv(k, v)
        write_kv(cache, layout, layer, slots, k, v)

    def attend(self, layer: int, q: torch.Tensor, q_positions: torch.Tensor, cache: torch.Tensor,
               layout: KVLayout, context_slots: torch.Tensor, context_positions: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` ``[S, Hq, D]`` at ``q_positions`` (int64[S]) over the context entries of
        ``layer`` at ``context_slots`` (int64[C], each in ``[0, layout.num_slots)``) whose
        ``context_positions`` (int64[C]) are ``<=`` the query's. Returns ``[S, Hq*D]`` (model dtype).
        Every query must see at least one entry."""
        layer = self._layer(layer)
        flat = self._cache(cache, layout)
        c = self.config
        q = self._rows("q", q, self.dtype, (None, c.num_heads, c.head_dim))
        q_positions = self._positions("q_positions", q_positions, q.shape[0])
        context_slots = check_slots("context_slots", context_slots, None, layout, self.device, allow_skip=False)
        context_positions = self._positions("context_positions", context_positions, context_slots.shape[0])
        self._check_visible(q_positions, context_positions)
        return self._attend(flat, layout, layer, q, q_positions, context_slots, context_positions)

    @staticmethod
    def _check_visible(q_positions, context_positions) -> None:
        if q_positions.numel() and (not context_positions.numel()
                                    or int(q_positions.min()) < int(context_positions.min())):
            raise ModelError(f"context_positions: a query at position {int(q_positions.min())} sees no context "
                             "entry (none at or before it)")

    def _attend(self, flat, layout, layer, q, q_positions, context_slots, context_positions):
        k, v = read_flat(flat, layout, layer, context_slots)
        return context_attention(q, q_positions, k, v, context_positions)

    def finish(self, layer: int, hidden_in: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The rest of ``layer``: ``o_proj(attn_out)`` + residual, post-attention norm, SwiGLU MLP +
        residual. ``hidden_in`` ``[S, E]``, ``attn_out`` ``[S, Hq*D]``; returns ``[S, E]``."""
        layer = self._layer(layer)
        hidden_in = self._hidden("hidden_in", hidden_in, self.config.hidden_size)
        attn_out = self._hidden("attn_out", attn_out, self.config.q_size, hidden_in.shape[0])
        return self._finish(layer, hidden_in, attn_out)

    def _finish(self, layer, hidden_in, attn_out):
        c, w = self.config, self.weights.layers[layer]
        h = hidden_in + F.linear(attn_out, w.o, w.o_bias)
        x = rms_norm(h, w.post_norm, c.rms_norm_eps)
        mlp = F.linear(F.silu(F.linear(x, w.gate, w.gate_bias)) * F.linear(x, w.up, w.up_bias), w.down, w.down_bias)
        return h + mlp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head: ``hidden`` ``[S, E]`` -> fp32 logits ``[S, vocab]`` (the head runs
        in the model dtype; its result is widened)."""
        hidden = self._hidden("hidden", hidden, self.config.hidden_size)
        return self._logits(hidden)

    def _logits(self, hidden):
        x = rms_norm(hidden, self.weights.norm, self.config.rms_norm_eps)
        return F.linear(x, self.weights.lm_head).float()

    # ------------------------------------------------------------------ whole passes
    def forward_layer(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
                      layout: KVLayout, slots: torch.Tensor, context_slots: torch.Tensor,
                      context_positions: torch.Tensor) -> torch.Tensor:
        """One layer for rows ``hidden`` ``[S, E]`` at ``positions``: qkv, write their K/V at ``slots``,
        attend over the context (which should include those slots), finish. Returns ``[S, E]``."""
        layer = self._layer(layer)
        args = self._pass_args(hidden, positions, cache, layout, slots, context_slots, context_positions)
        return self._forward_layer(layer, *args)

    def _pass_args(self, hidden, positions, cache, layout, slots, context_slots, context_positions):
        flat = self._cache(cache, layout)
        hidden = self._hidden("hidden", hidden, self.config.hidden_size)
        S = hidden.shape[0]
        positions = self._positions("positions", positions, S)
        slots = check_write_slots(slots, S, layout, self.device)
        context_slots = check_slots("context_slots", context_slots, None, layout, self.device, allow_skip=False)
        context_positions = self._positions("context_positions", context_positions, context_slots.shape[0])
        self._check_visible(positions, context_positions)
        return hidden, positions, flat, layout, slots, context_slots, context_positions

    def _forward_layer(self, layer, hidden, positions, flat, layout, slots, context_slots, context_positions):
        q, k, v = self._qkv(layer, hidden, positions)
        write_flat(flat, layout, layer, slots, k, v)
        a = self._attend(flat, layout, layer, q, positions, context_slots, context_positions)
        return self._finish(layer, hidden, a)

    def prefill(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, layout: KVLayout,
                slots: torch.Tensor, *, context_slots: torch.Tensor | None = None,
                context_positions: torch.Tensor | None = None, logits_rows=None) -> torch.Tensor:
        """Run rows ``token_ids`` (int64[S]) at ``positions`` (int64[S]) through every layer, writing their
        K/V at ``slots`` (int64[S]) and attending over the context.

        The rows may be any subset of a request's positions, given that the others are already in
        the cache: pass the request's whole context (``context_slots``/``context_positions``, int64[C],
        e.g. ``BlockTable.context(length)``; it should include ``slots``). Without them the context is
        the rows themselves (a prompt prefilled from scratch). ``logits_rows``: None for every row,
        else row indices (a list or int64 tensor; negative counts from the end). Returns fp32
        logits ``[R, vocab]``.
        """
        token_ids = self._token_ids(token_ids)
        hidden = F.embedding(token_ids, self.weights.embed)
        if (context_slots is None) != (context_positions is None):
            raise ModelError("context_slots/context_positions: pass both or neither")
        if context_slots is None:
            context_slots, context_positions = slots, positions
        args = list(self._pass_args(hidden, positions, cache, layout, slots, context_slots, context_positions))
        rows = self._logits_rows(logits_rows, hidden.shape[0])
        for layer in range(self.num_layers):
            args[0] = self._forward_layer(layer, *args)
        hidden = args[0]
        return self._logits(hidden if rows is None else hidden[rows])

    def _logits_rows(self, rows, S: int):
        if rows is None:
            return None
        rows = torch.as_tensor(rows, dtype=torch.int64)
        if rows.dim() != 1 or (rows.numel() and (int(rows.min()) < -S or int(rows.max()) >= S)):
            raise ModelError(f"logits_rows: expected row indices in [-{S}, {S}), got {rows.tolist()}")
        return rows.to(self.device)

    def generate(self, prompt_ids: torch.Tensor, table: BlockTable, cache: torch.Tensor, layout: KVLayout, *,
                 max_new_tokens: int, prefilled: int = 0, eos_token_ids=None) -> Generation:
        """Greedy decoding after ``prompt_ids`` (int64[P]) at positions ``0 .. P-1`` of ``table``.

        ``prefilled``: how many leading prompt positions already have their K/V in the cache (0 for a
        fresh request; the rest, at least the last, are prefilled here). Each new token is fed at the
        next position (the next slot of the table) until ``max_new_tokens`` or an id in
        ``eos_token_ids`` (default: the config's). The table must hold ``P + max_new_tokens - 1``
        positions; that is checked before any work.
        """
        prompt_ids = self._token_ids(prompt_ids)
        P = prompt_ids.shape[0]
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ModelError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        if isinstance(prefilled, bool) or not isinstance(prefilled, int) or not 0 <= prefilled < P:
            raise ModelError(f"prefilled: expected an int in [0, {P}) (the last prompt row is computed here), "
                             f"got {prefilled!r}")
        if not isinstance(table, BlockTable):
            raise ModelError(f"table: expected a BlockTable, got {type(table).__name__}")
        need = P + max_new_tokens - 1
        if need > table.capacity or need > self._max_positions:
            raise ModelError(f"table: generating {max_new_tokens} tokens after {P} needs {need} positions, the "
                             f"table holds {table.capacity} (the model {self._max_positions})")
        self._cache(cache, layout)
        blocks = table.block_ids[:-(-need // table.block_size)]
        if table.block_size != layout.block_size or max(blocks) >= layout.num_blocks:
            raise LayoutError(f"table: blocks of {table.block_size} with ids up to {max(blocks)} do not fit layout "
                              f"{layout.name} ({layout.num_blocks} blocks of {layout.block_size})")
        eos = set(self.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        ctx_slots, ctx_pos = table.context(P, self.device)
        rows = torch.arange(prefilled, P, device=self.device)
        logits = self.prefill(prompt_ids[prefilled:], rows, cache, layout, ctx_slots[prefilled:],
                              context_slots=ctx_slots, context_positions=ctx_pos, logits_rows=[-1])
        out, steps = [], [logits[0]]
        for i in range(max_new_tokens):
            token = int(torch.argmax(steps[-1]))
            out.append(token)
            if token in eos or i == max_new_tokens - 1:
                break
            ctx_slots, ctx_pos = table.context(P + i + 1, self.device)
            logits = self.prefill(torch.tensor([token], device=self.device), ctx_pos[-1:], cache, layout,
                                  ctx_slots[-1:], context_slots=ctx_slots, context_positions=ctx_pos)
            steps.append(logits[0])
        return Generation(token_ids=out, logits=torch.stack(steps))
