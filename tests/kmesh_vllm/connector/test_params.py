"""kv_transfer_params["kmesh"]: leaders' save ranges, children's segment references, refusals by field."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

KEY = "ab" * 32


@pytest.fixture(scope="module")
def p():
    from kmesh_vllm.connector import params

    return params


def test_no_kmesh_entry_is_not_ours(p):
    assert p.parse_request(None, 10) is None
    assert p.parse_request({"do_remote_prefill": True}, 10) is None


def test_leader_ranges_and_all(p):
    got = p.parse_request({"kmesh": {"save": [{"name": "a", "start": 2, "length": 3}, {"start": 5, "length": 5}]}}, 10)
    assert got == p.LeaderParams((p.SaveRange("a", 2, 3), p.SaveRange(None, 5, 5)))
    assert p.parse_request({"kmesh": {"save": "all"}}, 7) == p.LeaderParams((p.SaveRange(None, 0, 7),))
    assert p.parse_request({"kmesh": {"save": "all", "name": "doc"}}, 7).ranges[0].name == "doc"


def test_child_refs(p):
    got = p.parse_request({"kmesh": {"segments": [{"name": "a", "start": 0}, {"key": KEY, "start": 4}],
                                     "recompute_ratio": 0.3}}, 10)
    assert got == p.ChildParams((p.SegmentRef("a", None, 0), p.SegmentRef(None, KEY, 4)), 0.3)
    assert p.parse_request({"kmesh": {"segments": [{"name": "a", "start": 1}]}}, 10).recompute_ratio is None


@pytest.mark.parametrize("params, field", [
    ({"kmesh": []}, "kv_transfer_params.kmesh: expected an object"),
    ({"kmesh": {}}, "exactly one of 'save'"),
    ({"kmesh": {"save": "all", "segments": []}}, "exactly one of 'save'"),
    ({"kmesh": {"save": []}}, "kmesh.save: expected \"all\" or a non-empty list"),
    ({"kmesh": {"save": [{"start": 0}]}}, r"kmesh.save\[0\].length: missing"),
    ({"kmesh": {"save": [{"start": -1, "length": 2}]}}, r"save\[0\].start: expected an int >= 0"),
    ({"kmesh": {"save": [{"start": 0, "length": 0}]}}, r"save\[0\].length: expected an int >= 1"),
    ({"kmesh": {"save": [{"start": 8, "length": 3}]}}, r"save\[0\]: positions 8 .. 10 pass the prompt's end"),
    ({"kmesh": {"save": [{"name": "x", "start": 0, "length": 1}, {"name": "x", "start": 1, "length": 1}]}},
     r"save\[1\].name: 'x' is saved twice"),
    ({"kmesh": {"save": [{"start": 0, "length": 1, "len": 2}]}}, r"save\[0\].len: unknown field"),
    ({"kmesh": {"save": "all", "extra": 1}}, "kmesh.extra: unknown field"),
    ({"kmesh": {"segments": [{"start": 0}]}}, r"segments\[0\]: expected exactly one of 'name' and 'key'"),
    ({"kmesh": {"segments": [{"name": "a", "key": KEY, "start": 0}]}}, r"segments\[0\]: expected exactly one"),
    ({"kmesh": {"segments": [{"name": "a"}]}}, r"segments\[0\].start: missing"),
    ({"kmesh": {"segments": [{"key": "XYZ", "start": 0}]}}, r"segments\[0\].key: expected a segment key"),
    ({"kmesh": {"segments": [{"name": "a", "start": 10}]}}, r"segments\[0\].start: 10 is past the prompt's last"),
    ({"kmesh": {"segments": [{"name": "", "start": 0}]}}, r"segments\[0\].name: expected a non-empty string"),
    ({"kmesh": {"segments": [{"name": "a", "start": 0}], "recompute_ratio": 2}}, "recompute_ratio: expected a number"),
    ({"kmesh": {"segments": [{"name": "a", "start": 0}], "recompute_ratio": True}}, "recompute_ratio: expected"),
], ids=lambda v: None if isinstance(v, dict) else v[:30])
def test_refusals_name_the_field(p, params, field):
    from kmesh_vllm.connector import ConnectorError

    with pytest.raises(ConnectorError, match=field):
        p.parse_request(params, 10)
