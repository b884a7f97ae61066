"""One adapter per framework: the few primitives where Trio and asyncio differ.

Code written once for both orchestrators -- the shared test suite, the benchmark
workloads, the cancellation scenarios' runner -- takes a :class:`Framework` and asks
it for an orchestrator, a scripted stage, a task group, a sleep, a run. It sits
outside every hot path: a benchmark stage calls the channel's own ``put`` it was
handed, not the adapter.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from .._orchestrator import open_orchestrator
from ..testing._scripted import ScriptedStage, collect_outputs
from . import asyncio_testing
from .asyncio_orchestrator import EndOfOutputs, OrchestratorClosed, open_asyncio_orchestrator
from .plain_asyncio import open_plain_asyncio_orchestrator

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup
else:  # pragma: no cover - exercised by the 3.10 session
    from taskgroup import TaskGroup

__all__ = ["ASYNCIO", "ASYNCIO_PLAIN", "ASYNCIO_UVLOOP", "FRAMEWORKS", "TRIO", "Framework"]


@attrs.frozen
class Framework:
    """What differs between the Trio orchestrator and its asyncio twin.

    Attributes:
      name: ``"trio"``, ``"asyncio"``, ``"asyncio+uvloop"`` (the asyncio twin on
          uvloop) or ``"asyncio-plain"`` (the plain design, one item per queue hop).
      open_orchestrator: Its ``open_orchestrator``.
      ScriptedStage: Its scripted test stage.
      collect_outputs: Its test kit's ``collect_outputs``.
      settle: Wait until every other task is blocked.
      sleep: ``trio.sleep`` / ``asyncio.sleep``.
      checkpoint: Yield to the scheduler once.
      now: The loop's clock.
      event: A new event (``set()``, ``await wait()``).
      open_tasks: A task group with ``start_soon(fn, *args)`` (``async with``).
      outputs_channel: A new stage outputs channel: ``(put_nowait, receive side)``.
      EndOfOutputs: What ``next_output()`` raises after shutdown.
      Closed: What an admission after the block raises.
      run: ``run(fn, virtual_time=False)``: run ``fn()`` to completion on a fresh
          loop; with ``virtual_time``, time jumps whenever every task waits for it.
      batches: Whether its consumers can take outputs in batches
          (``next_outputs()``, ``receive_batch()``); the plain design cannot.
    """

    name: str
    open_orchestrator: Callable[..., Any]
    ScriptedStage: Callable[..., Any]
    collect_outputs: Callable[[Any], Any]
    settle: Callable[[], Any]
    sleep: Callable[[float], Any]
    checkpoint: Callable[[], Any]
    now: Callable[[], float]
    event: Callable[[], Any]
    open_tasks: Callable[[], Any]
    outputs_channel: Callable[[], tuple[Callable[[Any], None], Any]]
    EndOfOutputs: type[BaseException]
    Closed: type[BaseException]
    run: Callable[..., Any]
    batches: bool = True


def _trio_outputs() -> tuple[Callable[[Any], None], Any]:
    send, receive = trio.open_memory_channel[Any](float("inf"))
    return send.send_nowait, receive


def _run_trio(fn: Callable[[], Any], *, virtual_time: bool = False) -> Any:
    clock = trio.testing.MockClock(autojump_threshold=0) if virtual_time else None
    return trio.run(fn, clock=clock)


TRIO = Framework(
    name="trio",
    open_orchestrator=open_orchestrator,
    ScriptedStage=ScriptedStage,
    collect_outputs=collect_outputs,
    settle=trio.testing.wait_all_tasks_blocked,
    sleep=trio.sleep,
    checkpoint=trio.lowlevel.checkpoint,
    now=trio.current_time,
    event=trio.Event,
    open_tasks=trio.open_nursery,
    outputs_channel=_trio_outputs,
    EndOfOutputs=trio.EndOfChannel,
    Closed=trio.ClosedResourceError,
    run=_run_trio,
)


class _Tasks:
    """A TaskGroup with trio's spelling."""

    def __init__(self, group: TaskGroup) -> None:
        self._group = group

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        self._group.create_task(fn(*args))


@asynccontextmanager
async def _asyncio_tasks() -> AsyncIterator[_Tasks]:
    async with TaskGroup() as group:
        yield _Tasks(group)


def _asyncio_outputs() -> tuple[Callable[[Any], None], Any]:
    queue: asyncio.Queue[Any] = asyncio.Queue()
    return queue.put_nowait, queue


async def _asyncio_checkpoint() -> None:
    await asyncio.sleep(0)


def _asyncio_now() -> float:
    return asyncio.get_running_loop().time()


def _run_asyncio(fn: Callable[[], Any], *, virtual_time: bool = False) -> Any:
    if virtual_time:
        return asyncio_testing.run_with_virtual_time(fn)
    return asyncio.run(fn())


def _run_uvloop(fn: Callable[[], Any], *, virtual_time: bool = False) -> Any:
    if virtual_time:
        raise ValueError("uvloop has no virtual time")
    import uvloop

    return uvloop.run(fn())


ASYNCIO = Framework(
    name="asyncio",
    open_orchestrator=open_asyncio_orchestrator,
    ScriptedStage=asyncio_testing.AsyncioScriptedStage,
    collect_outputs=asyncio_testing.collect_outputs,
    settle=asyncio_testing.wait_all_tasks_blocked,
    sleep=asyncio.sleep,
    checkpoint=_asyncio_checkpoint,
    now=_asyncio_now,
    event=asyncio.Event,
    open_tasks=_asyncio_tasks,
    outputs_channel=_asyncio_outputs,
    EndOfOutputs=EndOfOutputs,
    Closed=OrchestratorClosed,
    run=_run_asyncio,
)

ASYNCIO_UVLOOP = attrs.evolve(ASYNCIO, name="asyncio+uvloop", run=_run_uvloop)

ASYNCIO_PLAIN = attrs.evolve(
    ASYNCIO, name="asyncio-plain", open_orchestrator=open_plain_asyncio_orchestrator, batches=False
)

#: The four frameworks by name (``"trio"``, ``"asyncio"``, ``"asyncio+uvloop"``,
#: ``"asyncio-plain"``); ``TRIO``, ``ASYNCIO``, ``ASYNCIO_UVLOOP`` and
#: ``ASYNCIO_PLAIN`` are each.
FRAMEWORKS = {fw.name: fw for fw in (TRIO, ASYNCIO, ASYNCIO_UVLOOP, ASYNCIO_PLAIN)}
"""Every framework, by name."""
