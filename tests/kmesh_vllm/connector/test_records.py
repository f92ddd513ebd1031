"""ConnectorRecords: names per namespace (restart-safe), receipts read once, any string as a name."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

KEY_A, KEY_B = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def Records():
    from kmesh_vllm.connector.records import ConnectorRecords

    return ConnectorRecords


def test_names_bind_and_rebind(Records, tmp_path):
    r = Records(tmp_path, namespace="t1", engine_id="e")
    assert r.lookup("doc") is None
    r.bind("doc", KEY_A)
    assert r.lookup("doc") == KEY_A
    r.bind("doc", KEY_B)
    assert Records(tmp_path, namespace="t1", engine_id="other").lookup("doc") == KEY_B  # a new engine finds it


def test_namespaces_do_not_see_each_other(Records, tmp_path):
    Records(tmp_path, namespace="t1", engine_id="e").bind("doc", KEY_A)
    assert Records(tmp_path, namespace="t2", engine_id="e").lookup("doc") is None


@pytest.mark.parametrize("name", ["../../etc/passwd", "a/b", "naïve ✓", "x" * 500, "."])
def test_any_string_is_a_name(Records, tmp_path, name):
    r = Records(tmp_path, namespace="n", engine_id="e")
    r.bind(name, KEY_A)
    assert r.lookup(name) == KEY_A
    assert all(p.is_relative_to(tmp_path / "vllm-connector") for p in tmp_path.rglob("*"))


def test_receipts_are_taken_once_per_engine(Records, tmp_path):
    a, b = Records(tmp_path, namespace="n", engine_id="e1"), Records(tmp_path, namespace="n", engine_id="e2")
    a.write_receipt("req-1", {"kind": "leader", "saved": []})
    assert b.take_receipt("req-1") is None          # another engine's request of the same id
    assert a.take_receipt("req-1") == {"kind": "leader", "saved": []}
    assert a.take_receipt("req-1") is None
    assert not list((tmp_path / "vllm-connector" / "receipts").rglob("*.tmp"))
