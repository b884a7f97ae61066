"""Small helpers shared by the tests."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from omni_trio import OrchOutput

#: ``OMNI_TRIO_TEST_SIZE=small``: the soak, the stress tests and the property tests
#: run smaller (nox runs them at full size on one Python, smaller on the others:
#: each property is still checked on every Python, and at full size once).
FULL_SIZE = os.environ.get("OMNI_TRIO_TEST_SIZE", "full") != "small"


def view(outputs: Iterable[OrchOutput]) -> list[tuple[int, Any, bool]]:
    """The seed's notation: ``(stage_id, data, finished)``."""
    return [(o.stage_id, o.data, o.finished) for o in outputs]


def warm(stage_id: int, prompt: str) -> str:
    """The seed's prewarm_fn."""
    return f"warm{stage_id}:{len(prompt)}"


def join_forward(stage_id: int, outputs: list[Any]) -> str:
    """A forward_fn that shows what it was given."""
    return f"from{stage_id}:" + "|".join(map(str, outputs))
