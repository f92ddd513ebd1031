"""The connector's configuration: one frozen :class:`ConnectorConfig`, read from vLLM's
``kv_connector_extra_config`` (the ``--kv-transfer-config`` JSON), and its error.

No environment variable is read: every setting comes from the engine's configuration, the same in
the scheduler and the worker process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from kmesh_gpu.errors import KmeshError


class ConnectorError(KmeshError, ValueError):
    """A setting, a request's ``kv_transfer_params`` or a vLLM cache the connector refuses; the
    message names the field."""


def _ints(name: str, v) -> tuple[int, ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not v or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise ConnectorError(f"kv_connector_extra_config.{name}: expected a non-empty list of layer numbers >= 0, "
                             f"got {v!r}")
    return tuple(v)


def _ratios(name: str, v) -> tuple[float, ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not v or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not 0 <= x <= 1
            for x in v):
        raise ConnectorError(f"kv_connector_extra_config.{name}: expected a non-empty list of numbers in [0, 1], "
                             f"got {v!r}")
    return tuple(float(x) for x in v)


def _text(name: str, v, *, optional: bool) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or "\0" in v:
        raise ConnectorError(f"kv_connector_extra_config.{name}: expected a non-empty string, got {v!r}")
    return v


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may hold (every key optional but one of the first two).

    Attributes:
        store_root: the segment store's root directory (a local path): segments, the names the
            leaders gave them and the connector's per-request receipts live under it. Restores run
            in the worker's process (vLLM's CPU cache is private memory).
        service_socket: the cache service's socket, for caches the service can write (CUDA IPC on
            a GPU). Not usable with vLLM's CPU backend; refused at registration there.
        namespace: the tenant namespace segment names live in (names of other namespaces are not
            seen; a segment key is global).
        blend_check_layers, blend_recompute_ratios, policy: the blender's settings (LMCache's names,
            :class:`kmesh_vllm.blend.BlendConfig`); a child's ``recompute_ratio`` replaces the ratios.
    """

    store_root: str | None = None
    service_socket: str | None = None
    namespace: str = "default"
    blend_check_layers: tuple[int, ...] = (1,)
    blend_recompute_ratios: tuple[float, ...] = (0.15,)
    policy: str = "cacheblend"

    def __post_init__(self):
        object.__setattr__(self, "store_root", _text("store_root", self.store_root, optional=True))
        object.__setattr__(self, "service_socket", _text("service_socket", self.service_socket, optional=True))
        if (self.store_root is None) == (self.service_socket is None):
            raise ConnectorError("kv_connector_extra_config: expected exactly one of store_root (a segment store "
                                 f"directory) and service_socket, got store_root={self.store_root!r}, "
                                 f"service_socket={self.service_socket!r}")
        if self.store_root is not None and "://" in self.store_root:
            raise ConnectorError(f"kv_connector_extra_config.store_root: expected a local directory, got "
                                 f"{self.store_root!r} (the connector keeps segment names beside the segments)")
        object.__setattr__(self, "namespace", _text("namespace", self.namespace, optional=False))
        object.__setattr__(self, "blend_check_layers", _ints("blend_check_layers", self.blend_check_layers))
        object.__setattr__(self, "blend_recompute_ratios",
                           _ratios("blend_recompute_ratios", self.blend_recompute_ratios))
        if not isinstance(self.policy, str):
            raise ConnectorError(f"kv_connector_extra_config.policy: expected a string, got {self.policy!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping | None) -> "ConnectorConfig":
        """The configuration in vLLM's ``kv_connector_extra_config`` (unknown keys are refused by name)."""
        extra = dict(extra or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConnectorError(f"kv_connector_extra_config.{unknown[0]}: unknown setting; expected some of "
                                 f"{known}")
        return cls(**extra)

    def blend_config(self, recompute_ratio: float | None = None):
        """The :class:`kmesh_vllm.blend.BlendConfig` of these settings (``recompute_ratio`` replaces the
        ratios); one greedy token, which vLLM recomputes (the blend only prepares the prompt's cache)."""
        from kmesh_vllm.blend import BlendConfig, BlendError

        ratios = self.blend_recompute_ratios if recompute_ratio is None else (recompute_ratio,)
        try:
            return BlendConfig(blend_check_layers=self.blend_check_layers, blend_recompute_ratios=ratios,
                               policy=self.policy, max_new_tokens=1)
        except BlendError as exc:
            raise ConnectorError(f"kv_connector_extra_config: {exc}") from exc
