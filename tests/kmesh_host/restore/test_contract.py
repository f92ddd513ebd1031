"""The restore contract's types (kmesh_host/restore/contract.py): what a RestoreItem and an item
list accept, and the result's views."""

from __future__ import annotations

import pytest
import torch

from kmesh_gpu.errors import LayoutError
from kmesh_host import RestoreItem, RestoreReport, RestoreResult
from kmesh_host.restore.contract import check_items


@pytest.mark.parametrize("kwargs,match", [
    (dict(key="", slots=torch.arange(3)), "key"),
    (dict(key=7, slots=torch.arange(3)), "key"),
    (dict(key="k", slots=None), "slots"),
    (dict(key="k", slots=[0, 1, 2]), "slots"),
    (dict(key="k", slots=torch.arange(3).int()), r"slots: expected an int64\[T\] tensor, got int32\[3\]"),
    (dict(key="k", slots=torch.arange(6).view(2, 3)), "slots"),
    (dict(key="k", slots=torch.arange(3), new_positions=torch.arange(3).float()), "new_positions"),
    (dict(key="k", slots=torch.arange(3), new_positions=torch.arange(4)), r"new_positions: expected int64\[3\]"),
])
def test_a_bad_item_is_refused_naming_the_field(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        RestoreItem(**kwargs)


def test_item_lists_are_checked():
    item = RestoreItem("k", torch.arange(3))
    assert check_items([item, item]) == [item, item] and check_items(iter([item])) == [item]
    for bad, match in [([], "at least one"), (item, "sequence"), ("abc", r"items\[0\]"), ([item, "k"], r"items\[1\]"),
                       (None, "sequence")]:
        with pytest.raises(LayoutError, match=match):
            check_items(bad)


def test_a_result_without_a_buffer_has_no_views():
    result = RestoreResult(RestoreReport(path="service", route="socket", mechanism="", device="cpu"))
    assert result.kv == [] and result.segments() == [] and result.report.to_dict()["path"] == "service"
