"""``synthetic``: the document-QA structure in random token ids, for models without meaningful text
(the ``tiny`` preset). Answers are unknown (None); every other property is ``document_qa``'s."""

from __future__ import annotations

import random

from .passages import _check_int
from .spec import ChildSpec, SegmentRef, Workload, WorkloadError


def synthetic(vocab_size: int, *, children: int = 4, segments: int = 4, segment_tokens: int = 104,
              prompt_tokens: int = 512, seed: int = 0, question_tokens: int = 8, first_id: int = 3) -> Workload:
    """Random-id segments ``seg0 ..`` (``segment_tokens`` each, ids in ``[first_id, vocab_size)``: the
    ids below are the special tokens); a leader holding them in order with short separators; children
    of exactly ``prompt_tokens`` tokens holding them shuffled, with random unshared gaps (some empty,
    at the start too) and ``question_tokens`` question tokens last."""
    _check_int("vocab_size", vocab_size, first_id + 1)
    _check_int("children", children, 1)
    _check_int("segments", segments, 1)
    _check_int("segment_tokens", segment_tokens, 1)
    _check_int("prompt_tokens", prompt_tokens, 1)
    _check_int("question_tokens", question_tokens, 1)
    rng = random.Random(seed)

    def ids(n: int) -> tuple:
        return tuple(rng.randrange(first_id, vocab_size) for _ in range(n))

    names = [f"seg{k}" for k in range(segments)]
    segs = {n: ids(segment_tokens) for n in names}
    free = prompt_tokens - segments * segment_tokens - question_tokens
    if free < 0:
        raise WorkloadError(f"prompt_tokens: {prompt_tokens} cannot hold {segments} segments of {segment_tokens} "
                            f"tokens and a {question_tokens}-token question")
    leader = [ids(4)]
    for n in names:
        leader += [SegmentRef(n), ids(3)]
    specs = []
    for c in range(children):
        order = names[:]
        rng.shuffle(order)
        cuts = sorted(rng.randint(0, free) for _ in range(segments))
        gaps = [b - a for a, b in zip([0] + cuts, cuts + [free])]
        parts = []
        for gap, n in zip(gaps, order):
            if gap:
                parts.append(ids(gap))
            parts.append(SegmentRef(n))
        parts.append(ids(gaps[-1] + question_tokens))
        specs.append(ChildSpec(f"child{c}", tuple(parts), None, names[c % segments]))
    return Workload(segs, tuple(leader), tuple(specs))
