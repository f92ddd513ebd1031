"""ConnectorConfig from vLLM's kv_connector_extra_config: defaults, and every refusal naming the field."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cc():
    from kmesh_vllm.connector import ConnectorConfig, ConnectorError

    return ConnectorConfig, ConnectorError


def test_defaults_follow_lmcache_names(cc, tmp_path):
    ConnectorConfig, _ = cc
    c = ConnectorConfig.from_extra_config({"store_root": str(tmp_path)})
    assert (c.namespace, c.blend_check_layers, c.blend_recompute_ratios, c.policy) == ("default", (1,), (0.15,),
                                                                                        "cacheblend")
    b = c.blend_config()
    assert (b.blend_check_layers, b.blend_recompute_ratios, b.policy, b.max_new_tokens) == ((1,), (0.15,),
                                                                                           "cacheblend", 1)
    assert c.blend_config(0.3).blend_recompute_ratios == (0.3,)


def test_settings_pass_through(cc, tmp_path):
    ConnectorConfig, _ = cc
    c = ConnectorConfig.from_extra_config({"store_root": str(tmp_path), "namespace": "tenant-a",
                                           "blend_check_layers": [1, 2], "blend_recompute_ratios": [0.2, 0.1],
                                           "policy": "kmesh"})
    assert (c.namespace, c.blend_check_layers, c.blend_recompute_ratios) == ("tenant-a", (1, 2), (0.2, 0.1))
    assert c.blend_config().policy == "kmesh"


@pytest.mark.parametrize("extra, field", [
    ({}, "exactly one of store_root"),
    ({"store_root": "/a", "service_socket": "/s"}, "exactly one of store_root"),
    ({"store_root": "s3://bucket/x"}, "store_root: expected a local directory"),
    ({"store_root": "/a", "blend_ratio": 0.1}, "kv_connector_extra_config.blend_ratio: unknown setting"),
    ({"store_root": "/a", "blend_recompute_ratios": 0.15}, "blend_recompute_ratios: expected a non-empty list"),
    ({"store_root": "/a", "blend_recompute_ratios": [1.5]}, "blend_recompute_ratios: expected a non-empty list"),
    ({"store_root": "/a", "blend_check_layers": [-1]}, "blend_check_layers: expected a non-empty list"),
    ({"store_root": "/a", "namespace": ""}, "namespace: expected a non-empty string"),
    ({"store_root": 7}, "store_root: expected a non-empty string"),
], ids=["neither", "both", "uri", "unknown-key", "ratio-scalar", "ratio-range", "negative-layer", "empty-namespace",
        "root-type"])
def test_refusals_name_the_field(cc, extra, field):
    ConnectorConfig, ConnectorError = cc
    with pytest.raises(ConnectorError, match=field.replace("(", r"\(")):
        ConnectorConfig.from_extra_config(extra)


def test_blend_settings_are_checked_by_the_blender(cc, tmp_path):
    ConnectorConfig, ConnectorError = cc
    c = ConnectorConfig.from_extra_config({"store_root": str(tmp_path), "policy": "best"})
    with pytest.raises(ConnectorError, match="policy"):
        c.blend_config()
    c = ConnectorConfig.from_extra_config({"store_root": str(tmp_path), "blend_check_layers": [2, 1]})
    with pytest.raises(ConnectorError, match="blend_check_layers"):
        c.blend_config()
