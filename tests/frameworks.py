"""One test body, two orchestrators: the Trio one and its asyncio twin.

A test written ``async def test_x(fw): ...`` and decorated with :func:`both` runs once
per framework: under trio with an autojumping MockClock, under asyncio on a
virtual-time loop. ``fw`` gives it what differs between the two.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

import omni_trio
from omni_trio.compare import EndOfOutputs, OrchestratorClosed, open_asyncio_orchestrator
from omni_trio.compare import asyncio_testing as aio
from omni_trio.testing import ScriptedStage, collect_outputs

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup
else:
    from taskgroup import TaskGroup


class Trio:
    name = "trio"
    open_orchestrator = staticmethod(omni_trio.open_orchestrator)
    ScriptedStage = ScriptedStage
    collect_outputs = staticmethod(collect_outputs)
    settle = staticmethod(trio.testing.wait_all_tasks_blocked)
    sleep = staticmethod(trio.sleep)
    now = staticmethod(trio.current_time)
    EndOfOutputs = trio.EndOfChannel
    Closed = trio.ClosedResourceError

    @staticmethod
    def open_tasks() -> Any:
        return trio.open_nursery()

    @staticmethod
    def event() -> Any:
        return trio.Event()

    @staticmethod
    def run(fn: Callable[[], Any]) -> Any:
        return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


class _Tasks:
    """A TaskGroup with trio's spelling."""

    def __init__(self, group: TaskGroup) -> None:
        self._group = group

    def start_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self._group.create_task(fn(*args))


class Asyncio:
    name = "asyncio"
    open_orchestrator = staticmethod(open_asyncio_orchestrator)
    ScriptedStage = aio.AsyncioScriptedStage
    collect_outputs = staticmethod(aio.collect_outputs)
    settle = staticmethod(aio.wait_all_tasks_blocked)
    sleep = staticmethod(asyncio.sleep)
    EndOfOutputs = EndOfOutputs
    Closed = OrchestratorClosed

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    @staticmethod
    @asynccontextmanager
    async def open_tasks() -> Any:
        async with TaskGroup() as group:
            yield _Tasks(group)

    @staticmethod
    def event() -> Any:
        return asyncio.Event()

    @staticmethod
    def run(fn: Callable[[], Any]) -> Any:
        return aio.run_with_virtual_time(fn)


FRAMEWORKS = [Trio, Asyncio]


def both(test: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``async def test(fw, ...)`` once under each framework."""

    @pytest.mark.parametrize("fw", FRAMEWORKS, ids=lambda fw: fw.name)
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:  # pytest passes fixtures by name
        return kwargs["fw"].run(functools.partial(test, *args, **kwargs))

    del run.__wrapped__  # pytest must see a plain function, not the coroutine one...
    run.__signature__ = inspect.signature(test)  # type: ignore[attr-defined]  # ...with its args
    return run
