"""Tools for testing code that uses omni_trio (and omni_trio itself).

:class:`ScriptedStage` is a :class:`~omni_trio.Stage` whose outputs a test emits by
hand, in any order, so that every interleaving the seed worries about can be written
down step by step.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing

from ._messages import OrchOutput, StageItem, StageOutput
from ._orchestrator import Orchestrator

__all__ = ["ScriptedStage", "collect_outputs"]


class ScriptedStage:
    """A :class:`~omni_trio.Stage` driven by the test.

    Args:
      on_submit: Awaited inside :meth:`submit` after the call is recorded: raise to
          make the submit fail, or block to make it slow.
      on_abort: The same for :meth:`abort`.

    Attributes:
      submissions: ``(request_id, inputs)`` of every :meth:`submit` call, in call
          order (recorded before ``on_submit`` runs).
      aborts: ``request_id`` of every :meth:`abort` call, in call order.
      releases: ``request_id`` of every :meth:`release` call, in call order.
      outputs: The receive side of the stage's output channel.
    """

    def __init__(
        self,
        *,
        on_submit: Callable[[str, Any], Awaitable[None]] | None = None,
        on_abort: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.submissions: list[tuple[str, Any]] = []
        self.aborts: list[str] = []
        self.releases: list[str] = []
        self._on_submit = on_submit
        self._on_abort = on_abort
        self._send, self.outputs = trio.open_memory_channel[StageItem](math.inf)

    async def submit(self, request_id: str, inputs: Any) -> None:
        self.submissions.append((request_id, inputs))
        if self._on_submit is not None:
            await self._on_submit(request_id, inputs)
        await trio.lowlevel.checkpoint()

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        if self._on_abort is not None:
            await self._on_abort(request_id)
        await trio.lowlevel.checkpoint()

    async def release(self, request_id: str) -> None:
        self.releases.append(request_id)
        await trio.lowlevel.checkpoint()

    async def emit(
        self,
        request_id: str,
        data: Any = None,
        finished: bool = False,
        error: str | None = None,
    ) -> None:
        """Put ``StageOutput(request_id, data, finished, error)`` on :attr:`outputs`."""
        self.emit_nowait(request_id, data, finished, error)
        await trio.lowlevel.checkpoint()

    def emit_nowait(
        self,
        request_id: str,
        data: Any = None,
        finished: bool = False,
        error: str | None = None,
    ) -> None:
        """Like :meth:`emit`, without a checkpoint (to emit several in one batch)."""
        self._send.send_nowait(StageOutput(request_id, data, finished, error))

    def emit_batch(self, outputs: list[StageOutput]) -> None:
        """Put several outputs on :attr:`outputs` as one item, as a stage that got them
        in one frame would (see :data:`omni_trio.StageItem`)."""
        self._send.send_nowait(list(outputs))

    def submitted_ids(self) -> list[str]:
        """The request ids of :attr:`submissions`, in order."""
        return [request_id for request_id, _ in self.submissions]

    def close(self) -> None:
        """End :attr:`outputs`, as a stage whose engine went away would."""
        self._send.close()


async def collect_outputs(orchestrator: Orchestrator) -> list[OrchOutput]:
    """Let every task run until blocked, then take every output that is ready.

    ``await collect_outputs(orch) == []`` asserts that the orchestrator, having
    processed everything it was given, has nothing to say.
    """
    await trio.testing.wait_all_tasks_blocked()
    outputs = []
    while True:
        try:
            outputs.append(orchestrator._results.get_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return outputs
