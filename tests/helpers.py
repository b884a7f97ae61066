"""Small helpers shared by the tests."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pytest

from omni_trio import OrchOutput

#: ``OMNI_TRIO_TEST_SIZE=small``: the soak, the stress tests and the property tests
#: run smaller (nox runs them at full size on one Python, smaller on the others:
#: each property is still checked on every Python, and at full size once).
FULL_SIZE = os.environ.get("OMNI_TRIO_TEST_SIZE", "full") != "small"
#: Marks a benchmark's smoke run (a quick run of the benchmark end to end): it keeps
#: the benchmark's code from rotting, which one Python shows as well as four, so it
#: runs at full size only. The benchmarks' pure parts (their goals, their reports)
#: are tested on every Python.
ONLY_FULL_SIZE = pytest.mark.skipif(
    not FULL_SIZE, reason="a benchmark's smoke run: on the full-size Python only"
)
#: Marks a run of the command line end to end (a server or the demo in a process of
#: its own): the command's code is the same on every Python, and the library under
#: it is tested on every Python, so it runs on the full-size Python only (the suite
#: on four Pythons stays within its time).
END_TO_END = pytest.mark.skipif(
    not FULL_SIZE, reason="the command line end to end: on the full-size Python only"
)
#: Marks a documented example's run (a script of README.md or docs/, in a process of
#: its own): the library under it is tested on every Python, so it runs on the
#: full-size Python only; the others compile it (its syntax is theirs too).
DOCUMENTED = pytest.mark.skipif(
    not FULL_SIZE, reason="a documented example's run: on the full-size Python only"
)


def view(outputs: Iterable[OrchOutput]) -> list[tuple[int, Any, bool]]:
    """The seed's notation: ``(stage_id, data, finished)``."""
    return [(o.stage_id, o.data, o.finished) for o in outputs]


def warm(stage_id: int, prompt: str) -> str:
    """The seed's prewarm_fn."""
    return f"warm{stage_id}:{len(prompt)}"


def join_forward(stage_id: int, outputs: list[Any]) -> str:
    """A forward_fn that shows what it was given."""
    return f"from{stage_id}:" + "|".join(map(str, outputs))
