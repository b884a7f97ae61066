"""The two message types that cross the orchestrator: what stages say, what users get.

Pure data (attrs, frozen, slotted). No trio or asyncio import: the sans-IO core and
both drivers share these.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

__all__ = ["FinishReason", "OrchOutput", "StageOutput"]

FinishReason = Literal["completed", "aborted", "error"]
"""Why a request ended; carried only by its terminal :class:`OrchOutput`."""


@attrs.frozen
class StageOutput:
    """One message from a stage engine about one request.

    Stages put these on their :attr:`~omni_trio.Stage.outputs` channel.

    Attributes:
      request_id: The request this output belongs to.
      data: The payload (a text delta, codec codes, an audio chunk...), or ``None``
          for a bare completion report.
      finished: ``True`` on the stage's last output for this request. Anything the
          stage sends for the request afterwards is dropped.
      error: If not ``None``, the stage failed this request; the message ends the
          request with an ``"error"`` terminal.
    """

    request_id: str
    data: Any = None
    finished: bool = False
    error: str | None = None


@attrs.frozen
class OrchOutput:
    """One message from the orchestrator to the user.

    Every request gets zero or more non-terminal outputs (``finished=False``), then
    exactly one terminal output (``finished=True``), which is always its last.

    Attributes:
      request_id: The request this output belongs to.
      stage_id: The final stage that produced ``data``. On a terminal output it is the
          stage whose output completed the request; on an ``"aborted"`` terminal, the
          request's last stage; on an ``"error"`` terminal, the stage that failed.
      data: The final stage's payload; ``None`` on ``"aborted"``/``"error"`` terminals.
      finished: ``True`` exactly on the request's terminal output.
      finish_reason: ``None`` on non-terminal outputs; ``"completed"``, ``"aborted"``
          or ``"error"`` on the terminal one.
      error: On ``"error"`` terminals, what failed: names the stage and the cause.
    """

    request_id: str
    stage_id: int
    data: Any
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
