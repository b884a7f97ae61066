"""What every driver of the core shares above the dispatcher, with no I/O: the
options of ``open_*`` (:class:`OrchestratorOptions`, checked once), building the
core from them, and a running orchestrator's read-only facts and :meth:`statistics`.

A driver's user handle subclasses :class:`OrchestratorBase`, which only reads; what
the dispatcher asks of the driver goes through one port,
:class:`omni_trio._dispatch.Driver`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from ._checks import (
    check_max_in_flight,
    check_positive_int,
    check_request_id,
    check_seconds,
    seconds,
)
from ._core import (
    MAX_FORWARD_BYTES,
    ForwardFn,
    InputFn,
    Mode,
    OrchestratorCore,
    PrewarmFn,
)
from ._dispatch import Dispatcher
from ._flow import CONSUMER_IDLE_TIMEOUT, MAX_UNREAD_BYTES, MAX_UNREAD_OUTPUTS, FlowLimits
from ._graph import Route, StageGraph
from ._priority import DEFAULT_AGING_S, check_aging
from ._util import final

__all__ = [
    "OrchestratorBase",
    "OrchestratorOptions",
    "OrchestratorStatistics",
    "options_of",
    "prepare",
]

S = TypeVar("S")


def _function(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{attribute.name} must be callable, got {value!r}")


def _stage_idle_timeout(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_seconds(attribute.name, value, positive=True, optional=True)


def _max_in_flight(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_max_in_flight(value)


def _aging(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_aging(value, attribute.name)


def _bound(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_positive_int(attribute.name, value)


def _as_graph(value: StageGraph | Sequence[Iterable[int]] | None) -> StageGraph | None:
    if value is None or isinstance(value, StageGraph):
        return value
    try:
        return StageGraph.of(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"graph: {exc}") from None


#: The functions that choose the mode: exactly one is given.
_MODE_FUNCTIONS = ("forward_fn", "input_fn", "prewarm_fn")


@final
@attrs.frozen(kw_only=True)
class OrchestratorOptions:
    """How an orchestrator runs: every keyword of :func:`open_orchestrator` (and of
    its asyncio twins), as one object.

    ``open_orchestrator(stages, finals, options=OrchestratorOptions(...))`` and
    ``open_orchestrator(stages, finals, max_in_flight=4, ...)`` are the same; given
    both, the keywords replace those fields of ``options``. Every field has a
    default but the mode's function. A bad value raises when the options are made,
    naming its field: ``ValueError`` for a value out of range, ``TypeError`` for a
    function that is not callable. :func:`attrs.evolve` copies one with fields
    changed, checked again.

    Attributes:
      forward_fn: Forward mode: ``forward_fn(stage_id, outputs)`` builds the input of
          the stages that read stage ``stage_id`` from the non-``None`` data it
          emitted, in order. A stage that reads several (a join) gets a ``dict``:
          per stage it reads, by index, ``forward_fn`` of that stage's data.
      input_fn: Forward mode too: ``input_fn(stage_id, outputs)`` builds stage
          ``stage_id``'s input, where ``outputs[k]`` is the data of stage ``k``,
          each stage it reads on the request's route: the graph's form of
          ``forward_fn``. In forward mode a stage is submitted once every stage it
          reads on the route has finished.
      prewarm_fn: async_chunk mode: ``prewarm_fn(stage_id, prompt)`` builds the
          placeholder input that a stage of the request's route other than its
          entries gets at admission.
      graph: Which stage reads which: ``graph[k]`` lists the stages stage ``k``
          reads (fan-in where it lists several, fan-out where several list one),
          or a :class:`StageGraph`. It must be acyclic. ``None`` (the default): a
          line, stage ``k`` reading stage ``k - 1``.
      stage_idle_timeout: The watchdog: if a submitted stage sends nothing for a
          request (since its submit or its last output) for this many seconds
          before finishing it, the request ends with an ``"error"`` terminal and
          its stages get ``abort``. ``None`` (the default) turns it off.
      max_in_flight: Admission control: :meth:`~Orchestrator.add_request` and
          :meth:`~Orchestrator.open_request` wait while this many requests are in
          flight, and hand the slots out by priority. ``None`` (the default): no
          limit.
      priority_aging_s: A request waiting for a ``max_in_flight`` slot gains one
          step of priority per this many seconds waited, so that low-priority work
          always gets in (``None``: strict priority, no aging).
      shutdown_grace: Seconds the shutdown, and a stream's abort when its block is
          left early, may spend delivering aborts.
      max_unread_bytes, max_unread_outputs: Flow control: each request may hold at
          most this many bytes (of ``bytes`` and ``str`` data) and outputs that its
          consumer has not taken. At the bound, its final stages that have a
          ``credit`` method (see :class:`Stage`) hold that request's engines -- and
          no other request's -- until the consumer reads on.
      consumer_idle_timeout: A request with an output that waited unread this many
          seconds ends with an ``"error"`` terminal saying so, and what it had
          waiting is dropped. A stage slow to produce is never idle: only an
          output waiting counts. ``0`` turns it off.
      max_forward_bytes: Forward mode: a request whose stage sends more than this
          many bytes of data for the next stage's input fails, naming the key.
      new_request_id: Makes the id of a request opened without one (``None``, the
          default: a random ``uuid4().hex``). A simulation gives ids drawn from its
          seed.

    Raises:
      ValueError: more than one of ``forward_fn``, ``input_fn`` and ``prewarm_fn``
          (none at all is refused when an orchestrator opens), a ``graph`` naming
          a stage that does not exist or with a cycle, a non-positive
          ``stage_idle_timeout``/``max_in_flight``/``max_unread_*``/
          ``max_forward_bytes``/``priority_aging_s``, or a negative
          ``shutdown_grace``/``consumer_idle_timeout``.
      TypeError: a function that is not callable, a ``graph`` that is not lists of
          stage indexes.
    """

    forward_fn: ForwardFn | None = attrs.field(default=None, validator=_function)
    input_fn: InputFn | None = attrs.field(default=None, validator=_function)
    prewarm_fn: PrewarmFn | None = attrs.field(default=None, validator=_function)
    graph: StageGraph | None = attrs.field(default=None, converter=_as_graph)
    stage_idle_timeout: float | None = attrs.field(default=None, validator=_stage_idle_timeout)
    max_in_flight: int | None = attrs.field(default=None, validator=_max_in_flight)
    priority_aging_s: float | None = attrs.field(default=DEFAULT_AGING_S, validator=_aging)
    shutdown_grace: float = attrs.field(default=5.0, validator=seconds(positive=False))
    max_unread_bytes: int = attrs.field(default=MAX_UNREAD_BYTES, validator=_bound)
    max_unread_outputs: int = attrs.field(default=MAX_UNREAD_OUTPUTS, validator=_bound)
    consumer_idle_timeout: float = attrs.field(
        default=CONSUMER_IDLE_TIMEOUT, validator=seconds(positive=False)
    )
    max_forward_bytes: int = attrs.field(default=MAX_FORWARD_BYTES, validator=_bound)
    new_request_id: Callable[[], str] | None = attrs.field(default=None, validator=_function)

    def __attrs_post_init__(self) -> None:
        if sum(getattr(self, name) is not None for name in _MODE_FUNCTIONS) > 1:
            raise ValueError(
                "give exactly one of forward_fn or input_fn (forward mode) and prewarm_fn "
                "(async_chunk mode)"
            )

    @property
    def limits(self) -> FlowLimits:
        """The flow-control bounds, for the dispatcher's ledger."""
        return FlowLimits(
            self.max_unread_bytes, self.max_unread_outputs, self.consumer_idle_timeout
        )


#: The names ``open_*`` take as keywords: the options' fields.
_FIELDS = frozenset(field.name for field in attrs.fields(OrchestratorOptions))


def options_of(
    options: OrchestratorOptions | None, keywords: Mapping[str, Any], opener: str
) -> OrchestratorOptions:
    """What ``opener(stages, final_stage_ids, options=options, **keywords)`` runs
    with: ``options`` (default: the defaults) with ``keywords`` replacing fields.

    Raises:
      TypeError: ``options`` is not an :class:`OrchestratorOptions`, or a keyword
          is not one of its fields.
      ValueError, TypeError: a bad value, as :class:`OrchestratorOptions` says.
    """
    if options is not None and not isinstance(options, OrchestratorOptions):
        raise TypeError(f"options must be an OrchestratorOptions, got {options!r}")
    unknown = sorted(set(keywords) - _FIELDS)
    if unknown:
        raise TypeError(
            f"{opener}() got an unexpected keyword argument {unknown[0]!r} "
            f"(its keywords are OrchestratorOptions' fields: {', '.join(sorted(_FIELDS))})"
        )
    if options is None:
        return OrchestratorOptions(**keywords)
    return attrs.evolve(options, **keywords) if keywords else options


def _output_types(final_stage_ids: object) -> dict[int, str] | None:
    """``final_stage_ids``' output types, if it is a mapping ``{stage_id: type}``.

    Raises:
      TypeError: a type that is not a ``str``.
      ValueError: an empty one.
    """
    if not isinstance(final_stage_ids, Mapping):
        return None
    for stage_id, kind in final_stage_ids.items():
        if not isinstance(kind, str):
            raise TypeError(
                f"final_stage_ids[{stage_id!r}] must be the stage's output type, a str "
                f'("text", "audio", ...), got {kind!r}'
            )
        if not kind:
            raise ValueError(f"final_stage_ids[{stage_id!r}]: an output type must not be empty")
    return dict(final_stage_ids)


def prepare(
    stages: Sequence[Any],
    final_stage_ids: Iterable[int] | Mapping[int, str],
    options: OrchestratorOptions,
    check_stage: Callable[[int, Any], S],
) -> tuple[OrchestratorCore, list[S]]:
    """Check the stages and the final stages of ``open_orchestrator`` (or a twin's);
    build the core with ``options``.

    Raises:
      TypeError, ValueError: as documented by :func:`omni_trio.open_orchestrator`.
    """
    checked = [check_stage(index, stage) for index, stage in enumerate(stages)]
    core = OrchestratorCore(
        len(checked),
        final_stage_ids,
        graph=options.graph,
        forward_fn=options.forward_fn,
        input_fn=options.input_fn,
        prewarm_fn=options.prewarm_fn,
        stage_idle_timeout=options.stage_idle_timeout,
        stage_names=[getattr(stage, "name", None) for stage in checked],
        max_forward_bytes=options.max_forward_bytes,
        fenced_stages=[
            i
            for i, stage in enumerate(checked)
            # fences come with releases: a stage that is not told of them sends none
            if getattr(stage, "reports_releases", False) is True
            and callable(getattr(stage, "release", None))
        ],
        output_types=_output_types(final_stage_ids),
    )
    return core, checked


@attrs.frozen
class OrchestratorStatistics:
    """A snapshot of an orchestrator, from :meth:`Orchestrator.statistics`.

    Attributes:
      mode: ``"forward"`` or ``"async_chunk"``.
      in_flight: Requests admitted and not yet ended.
      pending_final: In-flight requests whose terminal is held for a straggling stage.
      admitted: Requests admitted so far.
      completed: Requests that ended with a ``"completed"`` terminal.
      aborted: Requests that ended with an ``"aborted"`` terminal.
      errored: Requests that ended with an ``"error"`` terminal.
      dropped_outputs: Stage outputs dropped so far (late, unknown, or malformed).
      stages_alive: Per stage, ``False`` once it died (its outputs channel ended or
          reading it failed).
      streams_open: In-flight requests read through :meth:`Orchestrator.open_request`.
      outputs_ready: Outputs waiting to be taken with :meth:`Orchestrator.next_output`.
      commands_queued: Per stage, submits, aborts and releases decided but not yet
          delivered.
      admissions_waiting: Callers waiting for ``max_in_flight`` room or a drain.
      unread_outputs: Per stage, its outputs handed to consumers and not taken yet:
          in request streams (a batch a consumer holds counts until it asks for
          more), and in :meth:`~Orchestrator.next_output`'s queue.
      unread_bytes: Per stage, their bytes (``bytes`` and ``str`` data count their
          length, anything else 0).
      unread_requests: Requests that hold outputs unread, or are in flight (the
          flow-control ledger's entries: 0 once every request ended and was read).
    """

    mode: Mode
    in_flight: int
    pending_final: int
    admitted: int
    completed: int
    aborted: int
    errored: int
    dropped_outputs: int
    stages_alive: tuple[bool, ...]
    streams_open: int
    outputs_ready: int
    commands_queued: tuple[int, ...]
    admissions_waiting: int
    unread_outputs: tuple[int, ...] = ()
    unread_bytes: tuple[int, ...] = ()
    unread_requests: int = 0

    @property
    def total_unread_outputs(self) -> int:
        """``sum(unread_outputs)``."""
        return sum(self.unread_outputs)

    @property
    def total_unread_bytes(self) -> int:
        """``sum(unread_bytes)``."""
        return sum(self.unread_bytes)


class OrchestratorBase:
    """What a running orchestrator's handle does the same way whatever its framework:
    :meth:`add_request` (the dispatcher's admission), its options and the core's
    facts, and :meth:`statistics`. A driver's handle adds the calls that wait in its
    framework's way (streams, reads, abort, drain).
    """

    def __init__(self, dispatch: Dispatcher, options: OrchestratorOptions) -> None:
        self._dispatch = dispatch
        self._core = dispatch.core
        self._flow = dispatch.flow
        self._results = dispatch.results
        self._options = options

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        *,
        final_stage_ids: Iterable[int] | None = None,
        entry_stage_ids: Iterable[int] | None = None,
        priority: int = 0,
    ) -> None:
        """Admit one request; its outputs arrive through :meth:`next_output`.

        Args:
          request_id: Unique among the requests in flight (see "Reusing a request
              id" in the lifecycle docs).
          prompt: The input of the request's entry stages.
          final_stage_ids: This request's user-facing stages, a subset of the
              pipeline's (``{0}``: text only, stage 0 alone runs). Default: the
              pipeline's that its entries reach.
          entry_stage_ids: The stages that get ``prompt`` (``{1}``: enter at the
              talker with text to speak). Default: the graph's sources that reach
              the request's finals. The request runs its route: its entries, its
              finals and every stage on a path between them; no other stage is
              submitted (see :meth:`route`).
          priority: Lower runs earlier (as in vLLM), from ``-1000`` to ``1000``:
              the order in which the request waits for a ``max_in_flight`` slot,
              and, carried by every submit (:attr:`StageRequest.priority`), at
              every queue of its stages that honours it. Waiting ages it: it gains
              one step per ``priority_aging_s`` seconds waited, so nothing starves
              (see "Priority" in the lifecycle docs).

        Waits while ``max_in_flight`` requests are in flight, or while a
        :meth:`drain` is in progress, then hands the admission to the orchestrator
        and returns: it never waits for a stage, so a slow ``submit`` never blocks
        the caller. That hand-over is the commit point: if this call is cancelled,
        the request was not admitted; if it returns, the request will get exactly
        one terminal, even if the orchestrator shuts down before handling it. A
        failing ``prewarm_fn`` or a dead stage shows up as that terminal, not as an
        exception here.

        Raises:
          TypeError: ``request_id`` is not a ``str``, or ``final_stage_ids`` or
              ``entry_stage_ids`` is not a collection of stage indexes.
          ValueError: ``request_id`` is already in flight (nothing is submitted);
              ``final_stage_ids`` is not a subset of the pipeline's final stages;
              or the route is empty: a final that no entry reaches, an entry that
              reaches no final; or ``priority`` is not an integer in range.
          trio.ClosedResourceError: the orchestrator's block has exited (the
              asyncio twins raise :class:`~omni_trio.compare.OrchestratorClosed`).
        """
        await self._dispatch.admit(
            check_request_id(request_id),
            prompt,
            final_stage_ids,
            None,
            entry_stage_ids=entry_stage_ids,
            priority=priority,
        )

    @property
    def options(self) -> OrchestratorOptions:
        """What it runs with (:class:`OrchestratorOptions`)."""
        return self._options

    @property
    def mode(self) -> Mode:
        """``"forward"`` or ``"async_chunk"``."""
        return self._core.mode

    @property
    def final_stage_ids(self) -> frozenset[int]:
        """The pipeline's user-facing stages."""
        return self._core.final_stage_ids

    @property
    def output_types(self) -> dict[int, str]:
        """What each final stage's outputs are to the user, by stage id
        (``{0: "text", 2: "audio"}``), as ``final_stage_ids`` said: the
        :attr:`OrchOutput.output_type` of its outputs. Empty when it said none (a
        set)."""
        types = self._core.output_types
        return {sid: kind for sid, kind in enumerate(types) if kind is not None}

    @property
    def last_stage(self) -> int:
        """``max(final_stage_ids)``: the stage an ``"aborted"`` terminal names."""
        return self._core.last_stage

    @property
    def graph(self) -> StageGraph:
        """Which stage reads which (see :class:`~omni_trio.StageGraph`)."""
        return self._core.graph

    def route(
        self,
        *,
        entry_stage_ids: Iterable[int] | None = None,
        final_stage_ids: Iterable[int] | None = None,
    ) -> Route:
        """The route a request admitted with these keywords would run: its entries,
        its finals and every stage on a path between them (see :class:`~omni_trio.Route`).

        Raises:
          TypeError, ValueError: as admitting such a request would.
        """
        return self._core.request_route(entry_stage_ids, final_stage_ids)

    @property
    def max_in_flight(self) -> int | None:
        """Requests in flight at once before admissions wait; ``None``: no limit."""
        return self._options.max_in_flight

    @property
    def priority_aging_s(self) -> float | None:
        """How waiting for a ``max_in_flight`` slot ages a request's priority: one
        step per this many seconds (``None``: no aging)."""
        return self._options.priority_aging_s

    @property
    def max_unread_bytes(self) -> int:
        """Bytes of outputs a request may hold that its consumer has not taken; at the
        bound, its final stages that take credit hold its engines."""
        return self._options.max_unread_bytes

    @property
    def max_unread_outputs(self) -> int:
        """Outputs a request may hold that its consumer has not taken."""
        return self._options.max_unread_outputs

    @property
    def consumer_idle_timeout(self) -> float:
        """Seconds an output may wait unread before its request ends with an error
        (0: never)."""
        return self._flow.consumer_idle_timeout or 0.0

    @property
    def max_forward_bytes(self) -> int:
        """Forward mode: bytes a stage may send for the next stage's input, per request."""
        return self._core.max_forward_bytes

    @property
    def dropped_outputs(self) -> int:
        """Stage outputs dropped so far: for unknown or already-ended requests, from a
        stage not submitted for the request or that already finished it, or not a
        :class:`StageOutput` at all."""
        return self._core.dropped_outputs

    def statistics(self) -> OrchestratorStatistics:
        """Return a snapshot of counters and queue lengths."""
        core = self._core
        dispatch = self._dispatch
        unread_outputs, unread_bytes = self._flow.unread()  # (first: it settles)
        return OrchestratorStatistics(
            mode=core.mode,
            in_flight=core.in_flight,
            pending_final=core.pending_final,
            admitted=core.admitted,
            completed=core.completed,
            aborted=core.aborted,
            errored=core.errored,
            dropped_outputs=core.dropped_outputs,
            stages_alive=tuple(death is None for death in core.stage_deaths),
            streams_open=len(dispatch.streams),
            outputs_ready=self._results.ready(),
            commands_queued=tuple(dispatch.undelivered),
            admissions_waiting=dispatch.admissions_waiting,
            unread_outputs=tuple(unread_outputs),
            unread_bytes=tuple(unread_bytes),
            unread_requests=len(self._flow),
        )
