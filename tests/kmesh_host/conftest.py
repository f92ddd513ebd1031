"""Fixtures shared by the host-side tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def direct_dir(tmp_path):
    """A directory whose files are read with O_DIRECT (tmp_path unless its filesystem refuses it;
    the test skips, naming the refusals, where no candidate takes it): for tests of the O_DIRECT path."""
    from tests.helpers.io import o_direct_dir

    with o_direct_dir(tmp_path) as d:
        yield d
