"""Workload structure: requests from parts, spans never searched for, checks naming the field."""

from __future__ import annotations

import pytest
import torch

from kmesh_vllm.workload import ChildSpec, SegmentRef, SegmentSpan, Workload, WorkloadError

SEGS = {"a": (10, 11, 12), "b": (20, 21)}


def test_requests_are_their_parts_in_order():
    w = Workload(SEGS, ((1, 2), SegmentRef("a"), (3,), SegmentRef("b")),
                 (ChildSpec("x", (SegmentRef("b"), (5, 6, 7), SegmentRef("a"), (8,)), "yes", "a"),))
    leader = w.leader_request()
    assert leader.token_ids.tolist() == [1, 2, 10, 11, 12, 3, 20, 21] and leader.token_ids.dtype == torch.int64
    assert leader.segments == (SegmentSpan("a", 2, 3), SegmentSpan("b", 6, 2))
    (x,) = w.requests()
    assert x.token_ids.tolist() == [20, 21, 5, 6, 7, 10, 11, 12, 8]
    assert x.segments == (SegmentSpan("b", 0, 2), SegmentSpan("a", 5, 3)) and x.answer == "yes" and x.about == "a"
    for r in (leader, x):
        for span in r.segments:
            assert r.token_ids[span.start:span.end].tolist() == list(SEGS[span.name])


def test_spans_come_from_the_parts_even_where_the_text_repeats():
    # the segment's ids also occur in the text before it: a search would find the wrong place
    w = Workload({"a": (7, 7)}, None, (ChildSpec("x", ((7, 7, 7), SegmentRef("a"))),))
    assert w.requests()[0].segments == (SegmentSpan("a", 3, 2),)


@pytest.mark.parametrize("build,match", [
    (lambda: Workload({}, None, (ChildSpec("x", ((1,),)),)), "segments: expected at least one"),
    (lambda: Workload({"a": ()}, None, (ChildSpec("x", ((1,),)),)), "segments.a: a segment needs at least one token"),
    (lambda: Workload({"a": (1, -2)}, None, (ChildSpec("x", ((1,),)),)), r"segments.a\[1\]: expected a token id"),
    (lambda: Workload(SEGS, None, ()), "children: expected at least one child"),
    (lambda: Workload(SEGS, None, (ChildSpec("x", ((1,),)), ChildSpec("y", ((1,), SegmentRef("z"))))),
     r"children\[1\].parts\[1\].segment: unknown segment 'z'"),
    (lambda: Workload(SEGS, None, (ChildSpec("x", ((1,),)), ChildSpec("x", ((2,),)))),
     r"children\[1\].name: 'x' is used twice"),
    (lambda: Workload(SEGS, (SegmentRef("a"),), (ChildSpec("x", ((1,),)),)), "the leader must hold every segment"),
    (lambda: Workload(SEGS, None, (ChildSpec("x", ()),)), r"children\[0\].parts: expected a non-empty list"),
    (lambda: Workload(SEGS, None, (ChildSpec("x", ((1,),), about="q"),)), r"children\[0\].about: unknown segment 'q'"),
    (lambda: Workload(SEGS, None, (ChildSpec("x", ("text",)),)), r"children\[0\].parts\[0\]: expected a list of token"),
])
def test_bad_structure_names_the_field(build, match):
    with pytest.raises(WorkloadError, match=match):
        build()


def test_check_vocab_and_positions():
    w = Workload(SEGS, None, (ChildSpec("x", ((1, 2), SegmentRef("a"))),))
    w.check(vocab_size=30, max_positions=5)
    with pytest.raises(WorkloadError, match=r"segments.b: token id 20 is outside the model's vocabulary \(size 20\)"):
        w.check(vocab_size=20, max_positions=100)
    with pytest.raises(WorkloadError, match=r"children\[0\].parts: 5 prompt tokens \(\+3 generated\) pass the model's "
                                            r"limit of 6 positions"):
        w.check(vocab_size=30, max_positions=6, max_new_tokens=4)
