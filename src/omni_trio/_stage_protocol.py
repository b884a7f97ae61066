"""What the orchestrator needs from a stage engine."""

from __future__ import annotations

from typing import Protocol

import trio

from ._checks import check_stage_methods
from ._messages import StageItem, StageRequest

__all__ = ["Stage", "check_stage"]


class Stage(Protocol):
    """A stage engine as the Trio orchestrator sees it.

    The orchestrator owns one reader task per stage, which is the only consumer of
    :attr:`outputs`, and one delivery task per stage, which calls :meth:`submit` and
    :meth:`abort` one at a time, in the order the orchestrator decided them. Neither
    method is ever called concurrently with itself or the other for the same stage.

    A stage may also define ``async release(request_id)``: it is then called, in the
    same order, for every stage a request was submitted to once the request has its
    terminal -- never while a submitted stage has not reported completion, unless the
    request ended early (after its ``abort``). It is where a stage frees what it still
    holds for the request, such as shared-memory chunks a downstream stage reads.

    A stage may also define ``async credit(request_id, outputs, nbytes)``: flow
    control. It is then called, in the same order, for each request it is a final
    stage of: once before the request's ``submit``, with the request's whole window
    at this stage (``open_orchestrator``'s ``max_unread_outputs`` and
    ``max_unread_bytes``, split evenly among the request's final stages), and again
    whenever the request's consumer has taken half of it, with what was taken. A
    stage that honours it sends an output for a request only while it has credit
    for it: at least one output, and the output's bytes (the length of ``bytes`` or
    ``str`` data, 0 for anything else) -- or, for an output bigger than what is
    left, at least half its window. It holds that request's engine otherwise, and no
    other request's. Credit for a request the stage no longer knows is ignored.
    (:class:`~omni_trio.process.ProcessStage` takes credit; a stage without the
    method is never held, and its requests' unread outputs are only bounded in time,
    by ``consumer_idle_timeout``.)

    A stage with ``release`` may also set ``reports_releases = True``: it then puts
    ``StageOutput(request_id, released=True)`` on :attr:`outputs` in each
    ``release``, after every output of the submission that ended. The orchestrator
    drops the stage's outputs of that request id until the fence has come, so a
    later request with the same id never gets an earlier one's late outputs.
    (:class:`~omni_trio.process.ProcessStage` does.)

    Two optional attributes make error messages say more:

    * ``name`` (a ``str``): messages name the stage ``stage 0 (thinker)`` instead of
      ``stage 0``.
    * ``death_cause`` (a ``str``, or ``None`` while the stage is alive): why the stage
      is gone. It is read once :attr:`outputs` has ended, so set it before ending
      them; every request the death ends gets an ``"error"`` terminal saying
      ``stage 0 (thinker) died: <death_cause>`` (without one: ``... died: its
      outputs channel ended``). :class:`~omni_trio.process.ProcessStage` sets it
      (``exited with status 3``, ``no heartbeat for 10.0 s, killed``).
    """

    @property
    def outputs(self) -> trio.abc.ReceiveChannel[StageItem]:
        """Where the stage reports outputs for all of its requests. If it ends, or
        reading it raises, the stage is dead (see ``death_cause`` above).

        Each item is a :class:`StageOutput`, or a list of them that arrived together
        (one IPC frame, say): handing them over as one item costs one channel
        operation instead of one per output. A plain attribute is fine; a
        ``trio.MemoryReceiveChannel`` is read in batches.
        """

    async def submit(self, request: StageRequest) -> None:
        """Start work on a request: ``request`` is its envelope, a
        :class:`~omni_trio.StageRequest` (its id, its inputs here, its life, its
        route). Raising fails that request only.

        A stage written for omni-trio 0.x, ``submit(request_id, inputs)``, still
        works for one version: the orchestrator calls it that way, with an
        :class:`~omni_trio.OmniTrioDeprecationWarning` when it opens.
        """

    async def abort(self, request_id: str) -> None:
        """Stop work on a request and free what it holds.

        Must be idempotent and accept requests the stage no longer (or never) knew:
        the orchestrator sends it to every stage a request was submitted to, finished
        or not.
        """


def check_stage(index: int, stage: object) -> Stage:
    """Return ``stage`` if it looks like a :class:`Stage`, else raise ``TypeError``."""
    check_stage_methods(index, stage)
    outputs = stage.outputs  # type: ignore[attr-defined]
    if not isinstance(outputs, trio.abc.ReceiveChannel):
        raise TypeError(
            f"stages[{index}].outputs must be a trio.abc.ReceiveChannel, got {outputs!r}"
        )
    return stage  # type: ignore[return-value]
