"""What the Trio and asyncio scripted stages share: recording calls, emitting outputs.

Framework-neutral: a subclass supplies the outputs queue (``_put``), the checkpoint
each call ends with (``_checkpoint``) and ``close``. See
:class:`omni_trio.testing.ScriptedStage` and
:class:`omni_trio.compare.asyncio_testing.AsyncioScriptedStage`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ._messages import StageItem, StageOutput, StageRequest

__all__ = ["ScriptedStageBase"]


class ScriptedStageBase:
    """A stage driven by the test: it records every call and emits what it is told."""

    def __init__(
        self,
        *,
        on_submit: Callable[[str, Any], Awaitable[None]] | None = None,
        on_abort: Callable[[str], Awaitable[None]] | None = None,
        takes_credit: bool = False,
    ) -> None:
        #: ``(request_id, inputs)`` of every ``submit``, in call order.
        self.submissions: list[tuple[str, Any]] = []
        #: The envelope of every ``submit`` (its life and route too), in call order.
        self.requests: list[StageRequest] = []
        self.aborts: list[str] = []
        self.releases: list[str] = []
        #: ``(request_id, outputs, nbytes)`` of every ``credit`` call, in call order
        #: (a stage made with ``takes_credit=True`` has the method).
        self.credits: list[tuple[str, int, int]] = []
        if takes_credit:
            self.credit = self._credit
        #: Why the stage is gone, once :meth:`close` was given a cause.
        self.death_cause: str | None = None
        self._on_submit = on_submit
        self._on_abort = on_abort

    # -- what a framework's subclass supplies ----------------------------------------

    def _put(self, item: StageItem) -> None:
        raise NotImplementedError

    async def _checkpoint(self) -> None:
        raise NotImplementedError

    def close(self, cause: str | None = None) -> None:
        """End :attr:`outputs`, as a stage whose engine went away would; ``cause``
        becomes :attr:`death_cause` (what the orchestrator says it died of)."""
        raise NotImplementedError

    # -- the Stage protocol ------------------------------------------------------------

    async def submit(self, request: StageRequest) -> None:
        request_id, inputs = request.request_id, request.inputs
        self.submissions.append((request_id, inputs))
        self.requests.append(request)
        if self._on_submit is not None:
            await self._on_submit(request_id, inputs)
        await self._checkpoint()

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        if self._on_abort is not None:
            await self._on_abort(request_id)
        await self._checkpoint()

    async def release(self, request_id: str) -> None:
        self.releases.append(request_id)
        await self._checkpoint()

    async def _credit(self, request_id: str, outputs: int, nbytes: int) -> None:
        self.credits.append((request_id, outputs, nbytes))
        await self._checkpoint()

    def granted(self, request_id: str) -> tuple[int, int]:
        """The credit given for ``request_id`` so far: ``(outputs, nbytes)``, summed."""
        grants = [(o, b) for rid, o, b in self.credits if rid == request_id]
        return sum(o for o, _ in grants), sum(b for _, b in grants)

    # -- what the test does --------------------------------------------------------------

    async def emit(
        self,
        request_id: str,
        data: Any = None,
        finished: bool = False,
        error: str | None = None,
        *,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Put ``StageOutput(request_id, data, finished, error, meta=meta)`` on
        :attr:`outputs`."""
        self.emit_nowait(request_id, data, finished, error, meta=meta)
        await self._checkpoint()

    def emit_nowait(
        self,
        request_id: str,
        data: Any = None,
        finished: bool = False,
        error: str | None = None,
        *,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Like :meth:`emit`, without a checkpoint (to emit several in one batch)."""
        self._put(StageOutput(request_id, data, finished, error, meta=meta))

    def emit_batch(self, outputs: list[StageOutput]) -> None:
        """Put several outputs on :attr:`outputs` as one item, as a stage that got them
        in one frame would (see :data:`omni_trio.StageItem`)."""
        self._put(list(outputs))

    def submitted_ids(self) -> list[str]:
        """The request ids of :attr:`submissions`, in order."""
        return [request_id for request_id, _ in self.submissions]
