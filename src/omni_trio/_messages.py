"""The two message types that cross the orchestrator: what stages say, what users get.

Pure data, no trio or asyncio import: the sans-IO core and both drivers share these.
:class:`StageOutput` and :class:`OrchOutput` are built once per output, so they are
frozen :class:`msgspec.Struct`\\ s (about 50 ns to build here, against about 400 ns for
a frozen attrs class); :class:`RequestMetrics`, one per request, is a frozen attrs
class. To copy an output with some fields changed, use
:func:`msgspec.structs.replace` (``attrs.evolve`` is for attrs classes).
"""

# No ``from __future__ import annotations`` here: the structs' signatures are built
# from their annotations, which must then be objects, not names to look up in the
# module that re-exports them (``omni_trio``).
import itertools
from typing import Any, Literal

import attrs
import msgspec

from ._graph import Route

__all__ = [
    "FinishReason",
    "OrchOutput",
    "RequestMetrics",
    "StageItem",
    "StageOutput",
    "StageRequest",
    "next_life",
]

_lives = itertools.count(1)


def next_life() -> int:
    """A new life number, greater than every one before in this process.

    Every admission takes one (the core's ``seq``), so a life names one admission of
    one request id, whichever orchestrator admitted it: stages shared by successive
    orchestrators never take a reused id's two admissions for one.
    """
    return next(_lives)


class StageRequest(msgspec.Struct, frozen=True):
    """One request as a stage is handed it: the envelope that carries it from the
    orchestrator's core to the stage's engine (through a
    :class:`~omni_trio.process.ProcessStage`, to its worker, as it is).

    Attributes:
      request_id: The request's id; another request may use it once this one ended.
      inputs: What the stage runs on: the prompt at an entry stage, ``prewarm_fn``'s
          placeholder at another (async_chunk), what ``forward_fn``/``input_fn``
          built (forward).
      life: Which admission of ``request_id`` this is: a number, greater than every
          one before in the process (the core's ``seq``; one made without it gets
          a fresh one), the same at every stage of the request. Whatever a stage
          keeps per request id, and every message its engine's workers exchange
          about it, carries the life, so that a later request with the same id
          never takes this one's chunks or outputs for its own.
      route: The request's :class:`~omni_trio.Route`: its entries, its finals, every
          stage between them and which reads which; a stage that streams to others
          sends only to those on it. ``None`` (a stage called directly): every
          neighbour.
      priority: The request's scheduling priority (lower runs first, as vLLM's):
          what it was admitted with (``open_request(..., priority=)``), the same
          at every stage. A stage's queues honour it, aged (see docs/lifecycle.md,
          "Priority"); a stage may ignore it.
    """

    request_id: str
    inputs: Any = None
    life: int = msgspec.field(default_factory=next_life)
    route: Route | None = None
    priority: int = 0


FinishReason = Literal["completed", "aborted", "error"]
"""Why a request ended; carried only by its terminal :class:`OrchOutput`."""


class StageOutput(msgspec.Struct, frozen=True):
    """One message from a stage engine about one request.

    Stages put these on their :attr:`~omni_trio.Stage.outputs` channel. Immutable;
    :func:`msgspec.structs.replace` copies one with fields changed.

    Attributes:
      request_id: The request this output belongs to.
      data: The payload (a text delta, codec codes, an audio chunk...), or ``None``
          for a bare completion report.
      finished: ``True`` on the stage's last output for this request. Anything the
          stage sends for the request afterwards is dropped.
      error: If not ``None``, the stage failed this request; the message ends the
          request with an ``"error"`` terminal.
      released: Not an output but a fence, from a stage that says it sends them
          (``reports_releases = True``, see :class:`~omni_trio.Stage`): put on the
          channel by ``release(request_id)``, after every output of the request's
          submission that ended. Until it arrives, outputs of that request id are of
          the ended submission, and dropped: a later request with the same id never
          gets them.
      meta: What the stage says about ``data``, beside it (SGLang's ``meta_info``):
          a language model's token counts and why it stopped, say. Plain data;
          the orchestrator hands it on, unread, with the output it came with (a
          final stage's reaches the user's :attr:`OrchOutput.meta`).
    """

    request_id: str
    data: Any = None
    finished: bool = False
    error: str | None = None
    released: bool = False
    meta: dict[str, Any] | None = None


@attrs.frozen
class RequestMetrics:
    """Timings of one request, carried by its terminal :class:`OrchOutput`.

    All times are on the orchestrator's clock (``trio.current_time()`` for the Trio
    orchestrator), so they are exact under ``trio.testing.MockClock``.

    Attributes:
      arrival_time: When the orchestrator admitted the request.
      terminal_time: When its terminal output was emitted.
      first_output_times: Per final stage, when its first output was emitted to the
          user: time to first token (text stage) or packet (audio stage) is
          ``first_output_times[k] - arrival_time``.
      stage_finish_times: Per stage that reported ``finished=True``, when it did.
      num_outputs: Outputs emitted to the user for the request, terminal included.
      stage_submit_times: Per stage the request was submitted to, when the
          orchestrator submitted it (async_chunk: every stage at admission; forward:
          stage k+1 when stage k finished). With ``stage_finish_times`` this is each
          stage's active span, what :func:`omni_trio.timeline.plot_timeline` draws.
    """

    arrival_time: float
    terminal_time: float
    first_output_times: dict[int, float]
    stage_finish_times: dict[int, float]
    num_outputs: int
    stage_submit_times: dict[int, float] = attrs.field(factory=dict)

    @property
    def e2e_latency(self) -> float:
        """``terminal_time - arrival_time``."""
        return self.terminal_time - self.arrival_time

    def time_to_first_output(self, stage_id: int) -> float | None:
        """Seconds from arrival to stage ``stage_id``'s first output, if it had one."""
        first = self.first_output_times.get(stage_id)
        return None if first is None else first - self.arrival_time


class OrchOutput(msgspec.Struct, frozen=True):
    """One message from the orchestrator to the user.

    Every request gets zero or more non-terminal outputs (``finished=False``), then
    exactly one terminal output (``finished=True``), which is always its last.

    Immutable; :func:`msgspec.structs.replace` copies one with fields changed.
    Equality, hashing and ``repr`` leave ``metrics`` out: two outputs are the same
    message whatever their timings.

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
      metrics: On terminal outputs, the request's :class:`RequestMetrics`.
      meta: What the final stage said about ``data``, beside it
          (:attr:`StageOutput.meta`): a language model's token counts and why it
          stopped, say; ``None`` where it said nothing.
      output_type: What ``stage_id``'s outputs are to the user -- ``"text"``,
          ``"audio"``, ``"transcript"``, ... -- as the orchestrator was told
          (``final_stage_ids`` given as a mapping, ``{0: "text", 2: "audio"}``;
          :func:`~omni_trio.open_pipeline` passes each final stage's
          ``final_output_type``). ``None`` when it was not told (``final_stage_ids``
          given as a set), and on an ``"error"`` terminal of a stage that is not a
          final one. Read it instead of comparing ``stage_id`` with a pipeline's
          layout.
    """

    request_id: str
    stage_id: int
    data: Any
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    meta: dict[str, Any] | None = None
    output_type: str | None = None

    def _key(self) -> tuple[Any, ...]:
        return (
            self.request_id,
            self.stage_id,
            self.data,
            self.finished,
            self.finish_reason,
            self.error,
            None if self.meta is None else tuple(self.meta.items()),
            self.output_type,
        )

    def __eq__(self, other: object) -> bool:
        if type(other) is not OrchOutput:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        fields = (
            f"request_id={self.request_id!r}, stage_id={self.stage_id!r}, "
            f"data={self.data!r}, finished={self.finished!r}"
        )
        if self.finish_reason is not None:
            fields += f", finish_reason={self.finish_reason!r}"
        if self.error is not None:
            fields += f", error={self.error!r}"
        if self.meta is not None:
            fields += f", meta={self.meta!r}"
        if self.output_type is not None:
            fields += f", output_type={self.output_type!r}"
        return f"OrchOutput({fields})"


StageItem = StageOutput | list[StageOutput]
"""What a stage puts on its outputs: one output, or several that arrived together."""
