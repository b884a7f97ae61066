"""What the benchmarks that ask a served pipeline share: a shipped pipeline served on
127.0.0.1 in the bench's own process, and the summary of what its clients timed."""

from __future__ import annotations

import statistics
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

__all__ = ["percentile", "served", "summary"]


def percentile(values: list[float], q: float) -> float:
    """The value at ``q`` (0 to 1) of ``values``, the nearest rank at or above it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    """``{"n", "p50", "p90", "max"}`` of ``values``."""
    return {
        "n": len(values),
        "p50": statistics.median(values),
        "p90": percentile(values, 0.9),
        "max": max(values),
    }


@asynccontextmanager
async def served(
    name: str, config_changes: Callable[[Any], Any] | None = None
) -> AsyncIterator[str]:
    """The shipped pipeline ``name`` (its config changed by ``config_changes``, if
    given) served on a free port of 127.0.0.1 for the block: its URL."""
    from ..config import shipped_pipeline
    from ..serve import app_for_config, serve

    config = shipped_pipeline(name)
    if config_changes is not None:
        config = config_changes(config)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, app_for_config(config), port=0))
        yield url
        nursery.cancel_scope.cancel()
