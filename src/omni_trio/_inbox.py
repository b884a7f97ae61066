"""Messages to the handler task, in either driver: what arrives in its inbox.

Readers hand it stage outputs, callers their admissions, aborts and calls, delivery
tasks the submits that failed. The handler (the only task that touches the core)
applies them in arrival order (:meth:`omni_trio._dispatch.Dispatcher.apply`). These
are a driver's internal vocabulary: the core's commands to the stages are
:mod:`omni_trio._core`'s ``Stage*`` classes, and what crosses a process boundary is
the worker package's wire frames (``omni_trio.process.worker._wire``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import attrs

from ._core import StageSubmit
from ._graph import Route
from ._messages import StageItem
from ._sink import Sink

__all__ = [
    "AbortRequest",
    "AdmitRequest",
    "Call",
    "ClockTick",
    "DrainCall",
    "InboxMessage",
    "OutputsArrived",
    "ShutdownCall",
    "StageDied",
    "SubmitFailed",
]


@attrs.frozen
class OutputsArrived:
    """A batch of items from one stage's outputs: outputs, or lists of them."""

    stage_id: int
    items: Sequence[StageItem]


@attrs.frozen
class AdmitRequest:
    """A caller admits a request; ``sink`` is its stream's, or ``None`` for
    ``next_output()``. Sending it is the admission's commit point."""

    request_id: str
    prompt: Any
    route: Route
    sink: Sink | None
    priority: int = 0


@attrs.frozen
class AbortRequest:
    """A caller ends a request (``abort()``, or a stream's block left early)."""

    request_id: str


@attrs.frozen
class SubmitFailed:
    """A delivery task's ``stage.submit(...)`` raised ``error``."""

    command: StageSubmit
    error: Exception


@attrs.frozen
class StageDied:
    """A reader found its stage's outputs ended, or reading them failed."""

    stage_id: int
    reason: str


@attrs.frozen
class Call:
    """A message the handler answers by calling ``reply`` (the driver supplies it: an
    Event's ``set``, say)."""

    reply: Callable[[], None]


@attrs.frozen
class ClockTick(Call):
    """The idle clock's: an output may have waited unread for ``consumer_idle_timeout``
    (the handler's step looks, :meth:`~omni_trio._flow.FlowLedger.expire`, and
    answers it in the same turn)."""


@attrs.frozen
class DrainCall(Call):
    """Answered once no request is in flight."""


@attrs.frozen
class ShutdownCall(Call):
    """Abort everything, hand out the aborts, stop taking stage work; answered then."""


InboxMessage: TypeAlias = (
    OutputsArrived | AdmitRequest | AbortRequest | SubmitFailed | StageDied | Call
)
