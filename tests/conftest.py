"""Suite-wide fixtures."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo's per-code-object cache would otherwise fill up across tests
    (the same model forward compiled with many backends) and silently fall back to eager at its recompile limit."""
    torch._dynamo.reset()
    yield
