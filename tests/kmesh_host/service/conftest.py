"""Fixtures shared by the cache service's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def compiled():
    """The service's compiled host passes (Numba is a dependency: their absence is a failure, not a skip)."""
    from kmesh_host.service import _compiled

    c = _compiled.compiled()
    if c is None:
        pytest.fail("Numba is a dependency: the service's compiled passes must be available")
    return c
