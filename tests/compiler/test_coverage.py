"""AutoSP on patterns people train (issue 12): each against single-process training on 2 and 4 gloo ranks."""
from __future__ import annotations

import pytest

from tests.compiler.exactness import assert_exact


@pytest.mark.parametrize("world_size", [2, 4])
def test_logging_call_in_forward_does_not_break_the_graph(world_size):
    assert_exact(world_size, log_in_forward=True)
