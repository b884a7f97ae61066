"""The Trio :class:`ScriptedStage`: a stage whose outputs a test emits by hand, in any
order, so that any interleaving of outputs and completion reports can be written
down step by step."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing

from .._messages import OrchOutput, StageItem
from .._orchestrator import Orchestrator
from .._scripted_base import ScriptedStageBase

__all__ = ["ScriptedStage", "collect_outputs"]


class ScriptedStage(ScriptedStageBase):
    """A :class:`~omni_trio.Stage` driven by the test.

    Args:
      on_submit: Awaited inside :meth:`submit` after the call is recorded: raise to
          make the submit fail, or block to make it slow.
      on_abort: The same for :meth:`abort`.
      takes_credit: Give the stage a ``credit`` method (flow control, see
          :class:`~omni_trio.Stage`) that records each call in :attr:`credits`.

    Attributes:
      submissions: ``(request_id, inputs)`` of every :meth:`submit` call, in call
          order (recorded before ``on_submit`` runs).
      requests: The :class:`~omni_trio.StageRequest` of every :meth:`submit` call
          (its life and route too), in call order.
      aborts: ``request_id`` of every :meth:`abort` call, in call order.
      releases: ``request_id`` of every :meth:`release` call, in call order.
      credits: ``(request_id, outputs, nbytes)`` of every ``credit`` call, in call
          order (see :meth:`granted`).
      outputs: The receive side of the stage's output channel.
      death_cause: The ``cause`` given to :meth:`close`, else ``None``.
    """

    def __init__(
        self,
        *,
        on_submit: Callable[[str, Any], Awaitable[None]] | None = None,
        on_abort: Callable[[str], Awaitable[None]] | None = None,
        takes_credit: bool = False,
    ) -> None:
        super().__init__(on_submit=on_submit, on_abort=on_abort, takes_credit=takes_credit)
        self._send, self.outputs = trio.open_memory_channel[StageItem](math.inf)

    def _put(self, item: StageItem) -> None:
        self._send.send_nowait(item)

    async def _checkpoint(self) -> None:
        await trio.lowlevel.checkpoint()

    def close(self, cause: str | None = None) -> None:
        """End :attr:`outputs`, as a stage whose engine went away would; ``cause``
        becomes :attr:`death_cause`, which the orchestrator reports (``stage 0 died:
        <cause>``)."""
        self.death_cause = cause
        self._send.close()


async def collect_outputs(orchestrator: Orchestrator) -> list[OrchOutput]:
    """Let every task run until blocked, then take every output that is ready.

    ``await collect_outputs(orch) == []`` asserts that the orchestrator, having
    processed everything it was given, has nothing to say.
    """
    await trio.testing.wait_all_tasks_blocked()
    if not orchestrator.statistics().outputs_ready:
        return []
    return await orchestrator.next_outputs()  # every output ready: no wait
