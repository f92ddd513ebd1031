"""Quality of a blend against the full recomputation: teacher-forced logits, KL, agreement.

The reference is :meth:`Blender.full`'s outcome: its greedy answer tokens. A blended child is scored
on those same tokens (teacher forcing): the first from the logits its prompt gave, each later one
from the logits after feeding the reference's previous tokens over the child's blended cache.
"""

from __future__ import annotations

import torch

from kmesh_vllm.model import Model

from .outcome import BlendOutcome


def teacher_forced_logits(model: Model, outcome: BlendOutcome, token_ids: list[int]) -> torch.Tensor:
    """fp32 ``[n, vocab]``: the logits of ``token_ids`` (n >= 1) after ``outcome``'s prompt over its
    cache: row 0 is ``outcome.logits``; row ``j`` comes from feeding ``token_ids[:j]`` at positions
    ``T .. T+j-1`` (written into the child's blocks past the prompt; the prompt is not touched)."""
    T = outcome.prompt_length
    n = len(token_ids)
    if n <= 1:
        return outcome.logits[None].float()[:n]
    table = outcome.table
    slots, positions = table.context(T + n - 1, model.device)
    rows = torch.tensor(token_ids[:-1], dtype=torch.int64, device=model.device)
    later = model.prefill(rows, positions[T:], outcome.cache, outcome.layout, slots[T:].to(outcome.cache.device),
                          context_slots=slots.to(outcome.cache.device), context_positions=positions)
    return torch.cat([outcome.logits[None].to(later.device), later])


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """fp32 ``[n]``: ``KL(softmax(reference) || softmax(logits))`` per row (``[n, vocab]`` each)."""
    ref = torch.log_softmax(reference_logits.float(), dim=-1)
    got = torch.log_softmax(logits.float(), dim=-1)
    return (ref.exp() * (ref - got)).sum(-1)


def compare(model: Model, reference: BlendOutcome, outcome: BlendOutcome) -> dict:
    """``outcome`` against the ``reference`` (full recomputation) on the reference's answer tokens:
    ``answer_equal`` (the same greedy tokens), ``top1_agreement`` (share of the reference's tokens
    that are ``outcome``'s argmax under teacher forcing), ``mean_kl``/``max_kl`` over those tokens.
    Writes past ``outcome``'s prompt in its blocks (its generated tokens' K/V)."""
    ref_tokens = reference.token_ids
    ref_logits = reference.step_logits.float()
    got = teacher_forced_logits(model, outcome, ref_tokens).to(ref_logits.device)
    kl = kl_divergence(ref_logits, got)
    top1 = got.argmax(-1).cpu() == torch.tensor(ref_tokens)
    return {"answer_equal": outcome.token_ids == ref_tokens, "top1_agreement": float(top1.float().mean()),
            "top1_matches": int(top1.sum()), "tokens": len(ref_tokens), "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max())}


def answer_correct(tokenizer, token_ids: list[int], answer: str | None) -> bool | None:
    """Whether the decoded ``token_ids`` contain ``answer`` (case-insensitive); None without one."""
    if answer is None or tokenizer is None:
        return None
    return answer.lower() in tokenizer.decode(token_ids, skip_special_tokens=True).lower()
