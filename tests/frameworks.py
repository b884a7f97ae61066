"""One test body, every orchestrator: the Trio one, its asyncio twin, and the plain
asyncio design the benchmark measures them against.

A test written ``async def test_x(fw): ...`` and decorated with :func:`both` runs once
per orchestrator: under trio with an autojumping MockClock, under asyncio on a
virtual-time loop. ``fw`` (an :class:`omni_trio.compare.frameworks.Framework`) gives
it what differs between the two.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from omni_trio.compare.frameworks import ASYNCIO, ASYNCIO_PLAIN, TRIO

FRAMEWORKS = [TRIO, ASYNCIO, ASYNCIO_PLAIN]
#: The orchestrators that take outputs in batches too (``next_outputs()``,
#: ``receive_batch()``); the plain design takes one output per await.
BATCHED = [fw for fw in FRAMEWORKS if fw.batches]


def both(test: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``async def test(fw, ...)`` once per orchestrator, in virtual time."""
    return _over(FRAMEWORKS, test)


def batched(test: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``async def test(fw, ...)`` once per orchestrator in :data:`BATCHED`."""
    return _over(BATCHED, test)


def _over(frameworks: list[Any], test: Callable[..., Any]) -> Callable[..., Any]:
    @pytest.mark.parametrize("fw", frameworks, ids=lambda fw: fw.name)
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:  # pytest passes fixtures by name
        return kwargs["fw"].run(functools.partial(test, *args, **kwargs), virtual_time=True)

    del run.__wrapped__  # pytest must see a plain function, not the coroutine one...
    run.__signature__ = inspect.signature(test)  # type: ignore[attr-defined]  # ...with its args
    return run
