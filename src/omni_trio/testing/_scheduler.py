"""Trio's scheduler under a seed.

Trio picks the order of the tasks ready in each batch at random, from a module-level
``random.Random`` (``trio._core._run._r``); with
``_ALLOW_DETERMINISTIC_SCHEDULING`` it first sorts the batch by task creation, so
the order depends on that generator alone. That is what Hypothesis and pytest-trio
use to replay a test, and what a simulation seeds. Both are private to Trio:
:data:`SCHEDULER` names them in this one place, and ``tests/test_simulation.py``
fails loudly if a Trio release moves them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["SCHEDULER", "seeded_scheduler"]

#: Where Trio keeps its scheduler's randomness (``trio._core._run``).
SCHEDULER = trio._core._run  # noqa: SLF001 - see the module's docstring


def _check() -> None:
    generator = getattr(SCHEDULER, "_r", None)
    if not isinstance(generator, random.Random) or not hasattr(
        SCHEDULER, "_ALLOW_DETERMINISTIC_SCHEDULING"
    ):
        raise RuntimeError(
            f"trio {trio.__version__} keeps its scheduler's randomness elsewhere "
            "(trio._core._run._r and _ALLOW_DETERMINISTIC_SCHEDULING): a simulation "
            "cannot be made deterministic"
        )


@contextmanager
def seeded_scheduler(seed: int) -> Iterator[None]:
    """Inside, Trio schedules the ready tasks in an order drawn from ``seed``;
    afterwards as it did before, from fresh randomness."""
    _check()
    allowed = SCHEDULER._ALLOW_DETERMINISTIC_SCHEDULING  # noqa: SLF001
    SCHEDULER._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]  # noqa: SLF001
    SCHEDULER._r.seed(seed)  # noqa: SLF001
    try:
        yield
    finally:
        SCHEDULER._ALLOW_DETERMINISTIC_SCHEDULING = allowed  # type: ignore[misc]  # noqa: SLF001
        SCHEDULER._r.seed()  # noqa: SLF001 - fresh randomness again
