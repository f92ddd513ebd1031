"""Workload files: the documented format, string pieces tokenised alone, errors naming the field."""

from __future__ import annotations

import json

import pytest

from kmesh_vllm.model.tokenizer import tiny_tokenizer
from kmesh_vllm.workload import SegmentSpan, WorkloadError, load_workload, parse_workload, save_workload, synthetic


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_token_id_file_round_trip(tmp_path):
    w = synthetic(512, children=2, segments=2, segment_tokens=5, prompt_tokens=20, seed=4)
    again = load_workload(save_workload(w, tmp_path / "w.json"))
    assert again == w
    assert [r.segments for r in again.requests()] == [r.segments for r in w.requests()]


def test_string_pieces_are_tokenised_alone(tok, tmp_path):
    data = {"segments": {"fact": "The capital of France is Paris."},
            "leader": {"parts": ["<|im_start|>user\n", {"segment": "fact"}, " What?"]},
            "children": [{"name": "q", "parts": ["Numbers: 1 2 3 ", {"segment": "fact"}, [5, 6]], "answer": "Paris",
                          "about": "fact"}]}
    (tmp_path / "w.json").write_text(json.dumps(data))
    w = load_workload(tmp_path / "w.json", tok)
    fact = list(tok.encode("The capital of France is Paris.", add_special_tokens=False).ids)
    assert list(w.segments["fact"]) == fact
    (child,) = w.requests()
    head = list(tok.encode("Numbers: 1 2 3 ", add_special_tokens=False).ids)
    assert child.token_ids.tolist() == head + fact + [5, 6]
    assert child.segments == (SegmentSpan("fact", len(head), len(fact)),) and child.answer == "Paris"
    assert w.leader_request().token_ids[0].item() == 1               # <|im_start|> stays one special token


GOOD = {"segments": {"a": [1, 2], "b": [3]}, "children": [{"name": "x", "parts": [[9], {"segment": "a"}]}]}


@pytest.mark.parametrize("change,match", [
    (lambda d: d.pop("children"), "workload.children: missing"),
    (lambda d: d.update(extra=1), "workload: unknown field 'extra'"),
    (lambda d: d["children"].append({"name": "y", "parts": [{"segment": "a"}, [1], {"segment": "x"}]}),
     r"children\[1\].parts\[2\].segment: unknown segment 'x'"),
    (lambda d: d["children"][0]["parts"].append({"seg": "a"}), r"children\[0\].parts\[2\]: unknown field 'seg'"),
    (lambda d: d["children"][0]["parts"].append([1, "2"]), r"children\[0\].parts\[2\]\[1\]: expected a token id"),
    (lambda d: d["children"][0]["parts"].append([]), r"children\[0\].parts\[2\]: an empty piece"),
    (lambda d: d["children"][0]["parts"].append("text"), r"children\[0\].parts\[2\]: a string piece needs a tokenizer"),
    (lambda d: d["children"][0].update(answer=3), r"children\[0\].answer: expected a string"),
    (lambda d: d["children"][0].pop("name"), r"children\[0\].name: missing"),
    (lambda d: d["segments"].update(c=[]), "segments.c: a segment needs at least one token"),
    (lambda d: d.update(leader={"parts": [{"segment": "a"}]}), "the leader must hold every segment"),
    (lambda d: d.update(children=[]), "children: expected a non-empty list"),
])
def test_bad_files_name_the_field(change, match):
    data = json.loads(json.dumps(GOOD))
    change(data)
    with pytest.raises(WorkloadError, match=match):
        parse_workload(data)


def test_unreadable_files(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(WorkloadError, match="is not JSON"):
        load_workload(tmp_path / "bad.json")
