"""The sans-IO orchestrator core: every request's state, driven by the decision
table (:mod:`omni_trio._decisions`).

Nothing here awaits, and nothing imports trio or asyncio. Like h11 or h2, the core is
fed events (a request was admitted, a stage sent an output, a submit failed, the user
aborted) and buffers what the driver must do in response: outputs for the user
(:meth:`OrchestratorCore.take_outputs`) and commands for the stages
(:meth:`OrchestratorCore.take_commands`). The Trio orchestrator and the asyncio twin
are thin drivers around it, so the seed's decision table lives in exactly one place.

Because every method runs to completion without yielding, a driver that calls it from
a single task needs no lock: whatever a method reads and writes is consistent.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import attrs
import msgspec

from ._checks import check_positive_int, check_seconds
from ._decisions import (
    ALL_DONE,
    ALL_FINAL,
    ALREADY_FINISHED,
    DATA_FROM_FINAL,
    DATA_FROM_NON_FINAL,
    DROPS,
    EARLIER_LIFE,
    ERROR,
    FENCE,
    FINAL,
    HELD,
    KINDS,
    LAST,
    NOT_A_STAGE_OUTPUT,
    NOT_SUBMITTED,
    PLAN,
    UNHASHABLE_ID,
    UNKNOWN_REQUEST,
)
from ._graph import Route, StageGraph, stage_ids
from ._messages import OrchOutput, RequestMetrics, StageOutput, StageRequest, next_life
from ._util import SIZELESS_TYPES, describe, output_size, stage_label

__all__ = [
    "MAX_FORWARD_BYTES",
    "ForwardFn",
    "InputFn",
    "Mode",
    "OrchestratorCore",
    "PrewarmFn",
    "ReqState",
    "StageAbort",
    "StageCommand",
    "StageCredit",
    "StageRelease",
    "StageSubmit",
]

logger = logging.getLogger("omni_trio")

#: Forward mode: bytes of one stage's outputs collected for the next stage (256 MiB).
MAX_FORWARD_BYTES = 256 * 1024 * 1024

Mode = Literal["forward", "async_chunk"]
PrewarmFn: TypeAlias = Callable[[int, Any], Any]
"""``prewarm_fn(stage_id, prompt) -> placeholder input`` for stage ``stage_id``."""
ForwardFn: TypeAlias = Callable[[int, list[Any]], Any]
"""``forward_fn(stage_id, outputs) -> input for the stages that read stage_id``: the
shorthand of :data:`InputFn` for stages that read one stage each."""
InputFn: TypeAlias = Callable[[int, dict[int, list[Any]]], Any]
"""``input_fn(stage_id, outputs) -> input for stage_id``, where ``outputs[k]`` is
what stage ``k``, one of its inputs on the request's route, sent (forward mode)."""


@attrs.frozen
class StageSubmit:
    """Command: call ``stages[stage_id].submit(request)``."""

    stage_id: int
    request: StageRequest
    """The envelope: the request's id, its inputs at this stage, its life (the
    core's admission number, which tells a reused request id's lives apart) and its
    route."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def seq(self) -> int:
        """The request's life (:attr:`StageRequest.life`)."""
        return self.request.life


@attrs.frozen
class StageAbort:
    """Command: call ``stages[stage_id].abort(request_id)``."""

    stage_id: int
    request_id: str


@attrs.frozen
class StageRelease:
    """Command: the request has its terminal; ``stages[stage_id]`` may free what it
    holds for it (shared-memory chunks, bindings). Sent to every live stage the
    request was submitted to, after its terminal and after any :class:`StageAbort`: never while
    a submitted stage has not reported completion, unless the request ended early."""

    stage_id: int
    request_id: str


@attrs.frozen
class StageCredit:
    """Command: call ``stages[stage_id].credit(request_id, outputs, nbytes)``: the
    stage may send ``outputs`` more outputs, of ``nbytes`` more bytes, for the request
    (flow control, see :mod:`omni_trio._flow`). The first for a request comes before
    its :class:`StageSubmit`, with the request's whole window at that stage; the
    others give back what its consumer has taken since. Only stages with a ``credit``
    method get these, and only for the requests they are a final stage of."""

    stage_id: int
    request_id: str
    outputs: int
    nbytes: int


StageCommand: TypeAlias = StageSubmit | StageAbort | StageRelease | StageCredit
"""What the core tells a driver to do to one stage (see :meth:`OrchestratorCore.take_commands`)."""


@attrs.define(eq=False)
class ReqState:
    """What the orchestrator knows about one in-flight request.

    Attributes:
      route: The stages the request runs (its entries, its finals, every stage on
          a path between them) and which of them reads which; no other stage is
          ever submitted.
      final_stage_ids: This request's user-facing stages (``route.finals``, a subset
          of the pipeline's).
      last_stage: ``max(final_stage_ids)``: the stage an ``"aborted"`` terminal names.
      submitted: Stages the request was submitted to (async_chunk: every stage of
          its route, marked at admission before any submit is issued).
      finished: Stages that reported ``finished=True`` for the request.
      pending_final: The already-built ``"completed"`` terminal, held until every
          submitted stage has finished.
      forward_data: forward mode only: non-``None`` data per stage, kept until
          every stage that reads it on the route was submitted.
      forward_bytes: forward mode only: the bytes of the data in ``forward_data``
          (see :func:`omni_trio._util.output_size`), bounded by ``max_forward_bytes``.
      last_heard: Per submitted stage, when it was submitted or last sent an output
          (kept only when the watchdog is on).
      arrival, submit_times, first_output, finish_times, num_outputs: What becomes the
          terminal's :class:`~omni_trio.RequestMetrics`.
      priority: Its scheduling priority (lower first), carried by every submit.
    """

    request_id: str
    seq: int
    route: Route
    final_stage_ids: frozenset[int]
    last_stage: int
    arrival: float
    submitted: set[int] = attrs.field(factory=set)
    finished: set[int] = attrs.field(factory=set)
    pending_final: OrchOutput | None = None
    forward_data: dict[int, list[Any]] = attrs.field(factory=dict)
    forward_bytes: int = 0
    forward_sizes: dict[int, int] | None = None
    last_heard: dict[int, float] = attrs.field(factory=dict)
    submit_times: dict[int, float] = attrs.field(factory=dict)
    first_output: dict[int, float] = attrs.field(factory=dict)
    finish_times: dict[int, float] = attrs.field(factory=dict)
    num_outputs: int = 0
    priority: int = 0


def validate_final_stage_ids(final_stage_ids: Iterable[int], num_stages: int) -> frozenset[int]:
    """Check that ``final_stage_ids`` is a non-empty set of valid stage indexes."""
    return stage_ids("final_stage_ids", final_stage_ids, num_stages)


class OrchestratorCore:
    """The per-request state machine of an orchestrator, with no I/O.

    Args:
      num_stages: How many stages the pipeline has.
      final_stage_ids: The user-facing stages: a request's default finals.
      graph: Which stage reads which (a :class:`~omni_trio._graph.StageGraph`, or
          per stage the indexes of the stages it reads); ``None``: a line, stage
          ``k`` reading stage ``k - 1``.
      forward_fn: Selects forward mode (see :data:`ForwardFn`).
      input_fn: Selects forward mode too, for graphs (see :data:`InputFn`).
      prewarm_fn: Selects async_chunk mode (see :data:`PrewarmFn`).
      stage_idle_timeout: If not ``None``, a submitted stage that sends nothing for a
          request for this many seconds ends the request (see :meth:`expire`).
      stage_names: Per stage, a name for messages (``None``: none); see
          :func:`stage_label`.
      max_forward_bytes: forward mode: a request whose stage's collected data (the
          next stage's ``forward_fn`` input) grows over this many bytes fails.
      output_types: What each final stage's outputs are to the user (``"text"``,
          ``"audio"``, ...), by stage id: every :class:`OrchOutput` naming that stage
          carries it as its ``output_type`` (``None`` for the others).

    Exactly one of ``forward_fn``, ``input_fn`` and ``prewarm_fn`` must be given.

    Time is an input: the driver sets :attr:`now` (its clock's current time) before it
    feeds events; it stamps metrics and arms the watchdog.
    """

    def __init__(
        self,
        num_stages: int,
        final_stage_ids: Iterable[int],
        *,
        graph: StageGraph | Sequence[Iterable[int]] | None = None,
        forward_fn: ForwardFn | None = None,
        input_fn: InputFn | None = None,
        prewarm_fn: PrewarmFn | None = None,
        stage_idle_timeout: float | None = None,
        stage_names: Sequence[str | None] | None = None,
        max_forward_bytes: int = MAX_FORWARD_BYTES,
        fenced_stages: Iterable[int] = (),
        output_types: Mapping[int, str] | None = None,
    ) -> None:
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"a pipeline needs at least one stage, got {num_stages!r}")
        given = [fn for fn in (forward_fn, input_fn, prewarm_fn) if fn is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of forward_fn or input_fn (forward mode) and prewarm_fn "
                "(async_chunk mode)"
            )
        for name, fn in (
            ("forward_fn", forward_fn),
            ("input_fn", input_fn),
            ("prewarm_fn", prewarm_fn),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {fn!r}")
        check_seconds("stage_idle_timeout", stage_idle_timeout, positive=True, optional=True)
        check_positive_int("max_forward_bytes", max_forward_bytes)
        self.max_forward_bytes = max_forward_bytes
        self.num_stages = num_stages
        self.final_stage_ids = validate_final_stage_ids(final_stage_ids, num_stages)
        self.last_stage = max(self.final_stage_ids)
        if graph is None:
            graph = StageGraph.linear(num_stages)
        elif not isinstance(graph, StageGraph):
            graph = StageGraph.of(graph)
        if graph.num_stages != num_stages:
            raise ValueError(
                f"the stage graph has {graph.num_stages} stages, the pipeline {num_stages}"
            )
        #: Which stage reads which.
        self.graph = graph
        #: The route of a request that names neither its entries nor its finals.
        self.default_route = graph.route(finals=self.final_stage_ids)
        self._routes: dict[tuple[frozenset[int] | None, frozenset[int] | None], Route] = {}
        self.mode: Mode = "async_chunk" if prewarm_fn is not None else "forward"
        #: How error messages name the function that builds a stage's input.
        self._input_fn_name = "input_fn" if forward_fn is None else "forward_fn"
        if forward_fn is not None:
            input_fn = _from_forward_fn(forward_fn)
        self.stage_idle_timeout = stage_idle_timeout
        names = list(stage_names or ())[:num_stages]
        names += [None] * (num_stages - len(names))
        #: Per stage, how error messages name it (``stage 0 (thinker)``).
        self.stage_labels = [stage_label(sid, name) for sid, name in enumerate(names)]
        #: Per stage, its outputs' ``OrchOutput.output_type`` (``None``: not told).
        self.output_types: tuple[str | None, ...] = tuple(
            (output_types or {}).get(sid) for sid in range(num_stages)
        )
        #: The driver's clock, set by the driver before it feeds events.
        self.now = 0.0
        #: Per stage: ``None`` while alive, else why it died (its cause, as the stage
        #: or its reader said it: ``exited with status 3``).
        self.stage_deaths: list[str | None] = [None] * num_stages
        self._input_fn = input_fn
        self._prewarm_fn = prewarm_fn
        self._requests: dict[str, ReqState] = {}
        self._outputs: list[OrchOutput] = []
        self._commands: list[StageCommand] = []
        self._timers: list[tuple[float, int, int, str]] = []  # (deadline, seq, stage, id)
        #: The stages that put a ``released`` fence on their outputs after each
        #: release, and the fences still to come: (request id, stage) -> how many.
        #: Until its fence, a stage's outputs of that id are of an ended submission.
        self._fenced = frozenset(fenced_stages)
        self._fences: dict[tuple[str, int], int] = {}
        #: Totals since creation.
        self.admitted = 0
        self.completed = 0
        self.aborted = 0
        self.errored = 0
        self.dropped_outputs = 0

    # -- what the driver reads -----------------------------------------------------

    def take_outputs(self) -> list[OrchOutput]:
        """Return and forget the outputs for the user, in the order they were decided."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def take_commands(self) -> list[StageCommand]:
        """Return and forget the stage commands, in the order they were decided.

        A driver must deliver the commands of one stage in this order (a request's
        ``StageAbort`` always follows its ``StageSubmit``); commands of different stages
        are independent.
        """
        commands, self._commands = self._commands, []
        return commands

    def next_deadline(self) -> float | None:
        """When :meth:`expire` may next have work, or ``None`` (watchdog idle or off)."""
        return self._timers[0][0] if self._timers else None

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet ended."""
        return len(self._requests)

    @property
    def pending_final(self) -> int:
        """In-flight requests whose terminal is held for a straggling stage."""
        return sum(st.pending_final is not None for st in self._requests.values())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def state(self, request_id: str) -> ReqState | None:
        """The state of an in-flight request (for inspection; do not mutate it)."""
        return self._requests.get(request_id)

    def check_new_id(self, request_id: str) -> None:
        """Raise ``ValueError`` if ``request_id`` is in flight."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")

    def request_route(
        self,
        entry_stage_ids: Iterable[int] | None = None,
        final_stage_ids: Iterable[int] | None = None,
    ) -> Route:
        """A request's route: from ``entry_stage_ids`` (``None``: the graph's sources
        that reach its finals) to ``final_stage_ids`` (``None``: the pipeline's final
        stages that its entries reach).

        Raises:
          TypeError, ValueError: not collections of stage indexes; finals that are not
              a subset of the pipeline's; a final that no entry reaches; an entry that
              reaches no final.
        """
        if entry_stage_ids is None and final_stage_ids is None:
            return self.default_route
        try:
            key = (
                None if entry_stage_ids is None else frozenset(entry_stage_ids),
                None if final_stage_ids is None else frozenset(final_stage_ids),
            )
            route = self._routes.get(key)
        except TypeError:  # unhashable: the graph says what is wrong
            key, route = None, None
        if route is not None:
            return route
        route = self.graph.route(
            entry_stage_ids, final_stage_ids, allowed_finals=self.final_stage_ids
        )
        if key is not None and len(self._routes) < _MAX_ROUTES:
            self._routes[key] = route
        return route

    def request_finals(self, final_stage_ids: Iterable[int] | None) -> frozenset[int]:
        """Validate a request's own final stages (``None``: the pipeline's).

        Raises:
          TypeError, ValueError: not a non-empty subset of the pipeline's final stages.
        """
        return self.request_route(None, final_stage_ids).finals

    # -- events ----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        final_stage_ids: Iterable[int] | None = None,
        entry_stage_ids: Iterable[int] | None = None,
        *,
        route: Route | None = None,
        priority: int = 0,
    ) -> None:
        """Admit a request and issue its first submits.

        Its route (``route``, one :meth:`request_route` made already; else made now
        from ``entry_stage_ids`` and ``final_stage_ids``) says which stages it runs.
        async_chunk: ``submitted`` = every stage of the route, recorded before any
        submit is issued; the entries get ``prompt``, every other stage ``k``
        ``prewarm_fn(k, prompt)``. All placeholders are built first, so a failing
        ``prewarm_fn`` submits nothing. forward: the entries get ``prompt``; a stage
        is submitted once every stage it reads on the route has finished.

        A request that needs a dead stage, or whose ``prewarm_fn`` raises, is admitted
        and ends at once with an ``"error"`` terminal. Every submit carries
        ``priority`` (checked by the caller, see :func:`omni_trio._priority.check_priority`).

        Raises:
          ValueError: ``request_id`` is already in flight (nothing is submitted), or
              the route is not valid (see :meth:`request_route`).
        """
        self.check_new_id(request_id)
        if route is None:
            route = self.request_route(entry_stage_ids, final_stage_ids)
        self.admitted += 1
        st = ReqState(request_id, next_life(), route, route.finals, route.last_stage, self.now)
        st.priority = priority
        for sid in route.stages:
            if self.stage_deaths[sid] is not None:
                self._end(st, self._error(st, sid, self._death_message(sid)))
                return
        entries = route.entries
        if self._prewarm_fn is None:
            self._requests[request_id] = st
            for sid in route.stages:
                if sid in entries:
                    self._submit(st, sid, prompt)
            return
        inputs = []
        for sid in route.stages:
            if sid in entries:
                inputs.append(prompt)
                continue
            try:
                inputs.append(self._prewarm_fn(sid, prompt))
            except Exception as exc:
                message = f"prewarm_fn for stage {sid} raised {describe(exc)}"
                self._end(st, self._error(st, sid, message))
                return
        st.submitted.update(route.stages)  # all of them, before any submit
        self._requests[request_id] = st
        for sid, stage_input in zip(route.stages, inputs, strict=True):
            self._submit(st, sid, stage_input)

    def receive_output(self, stage_id: int, output: object) -> None:
        """Apply the decision table (:data:`omni_trio._decisions.TABLE`) to one
        output of stage ``stage_id``: classify it into the table's key, look its
        steps up (:data:`~omni_trio._decisions.PLAN`), and take them.

        ``output`` should be a :class:`StageOutput`; anything else is dropped (and
        counted) like any other output that cannot be used.
        """
        # What the output is: the first of the table's OUTPUTS that applies. The
        # lookups' kinds alone decide (drop, lift fence, fail).
        if not isinstance(output, StageOutput):
            self._decide_by_kind(NOT_A_STAGE_OUTPUT, stage_id, output, None)
            return
        try:
            st = self._requests.get(output.request_id)
        except TypeError:  # unhashable request_id
            self._decide_by_kind(UNHASHABLE_ID, stage_id, output, None)
            return
        if output.released:
            self._decide_by_kind(FENCE, stage_id, output, st)
            return
        if st is None:
            self._decide_by_kind(UNKNOWN_REQUEST, stage_id, output, st)
            return
        if self._fences and (st.request_id, stage_id) in self._fences:
            self._decide_by_kind(EARLIER_LIFE, stage_id, output, st)
            return
        if stage_id not in st.submitted:
            self._decide_by_kind(NOT_SUBMITTED, stage_id, output, st)
            return
        if stage_id in st.finished:
            self._decide_by_kind(ALREADY_FINISHED, stage_id, output, st)
            return
        if output.error is not None:
            self._decide_by_kind(ERROR, stage_id, output, st)
            return

        # Data, or the stage's last output: count it, then its key and the key's plan.
        if self.stage_idle_timeout is not None:
            st.last_heard[stage_id] = self.now
        if output.finished:
            finished = st.finished
            finished.add(stage_id)
            st.finish_times[stage_id] = self.now
            key = LAST
            if stage_id in st.final_stage_ids:
                key += FINAL
            if st.final_stage_ids <= finished:
                key += ALL_FINAL
            if st.submitted <= finished:
                key += ALL_DONE
            if st.pending_final is not None:
                key += HELD
            plan = PLAN[key]
        elif stage_id in st.final_stage_ids:  # data: its stage's role is its whole key
            plan = DATA_FROM_FINAL
        else:
            plan = DATA_FROM_NON_FINAL
        data = output.data
        forwards = self._input_fn is not None and st.route.outputs[stage_id]
        if forwards and data is not None:
            kind = type(data)  # (the common payloads' sizes inline: this runs per output)
            if kind is str or kind is bytes:
                size = len(data)
            else:
                size = 0 if kind in SIZELESS_TYPES else output_size(data)
            if size:
                st.forward_bytes += size
                if st.forward_bytes > self.max_forward_bytes:
                    self._fail(
                        st,
                        stage_id,
                        f"{self.stage_labels[stage_id]} sent more than {self.max_forward_bytes} "
                        f"bytes for the next stage's input (max_forward_bytes)",
                    )
                    return
                sizes = st.forward_sizes
                if sizes is None:
                    sizes = st.forward_sizes = {}
                sizes[stage_id] = sizes.get(stage_id, 0) + size
            st.forward_data.setdefault(stage_id, []).append(data)

        if plan.to_user:
            if plan.stream:
                st.num_outputs += 1
                if stage_id not in st.first_output:
                    st.first_output[stage_id] = self.now
                self._outputs.append(
                    OrchOutput(
                        st.request_id,
                        stage_id,
                        data,
                        False,
                        meta=output.meta,
                        output_type=self.output_types[stage_id],
                    )
                )
            else:
                terminal = OrchOutput(
                    st.request_id,
                    stage_id,
                    data,
                    True,
                    "completed",
                    meta=output.meta,
                    output_type=self.output_types[stage_id],
                )
                if plan.complete:
                    self._end(st, terminal)
                else:  # hold
                    st.pending_final = terminal
                return
        elif plan.release_held:
            held = st.pending_final
            assert held is not None
            self._end(st, held)
            return

        if forwards and plan.forward:
            self._forward(st, stage_id)

    def _decide_by_kind(
        self, kind: str, stage_id: int, output: object, st: ReqState | None
    ) -> None:
        """Take the steps of an output whose kind alone decides (the table's lookups:
        drop it, lift a fence, or fail its request)."""
        plan = PLAN[KINDS[kind]]
        if plan.drop:
            why, level = DROPS[kind]
            self._drop(stage_id, output, why, level=level)
        elif plan.lift_fence:
            assert isinstance(output, StageOutput)
            self._lift_fence(output.request_id, stage_id)
        elif plan.fail:
            assert st is not None
            assert isinstance(output, StageOutput)
            self._fail(st, stage_id, f"{self.stage_labels[stage_id]} failed: {output.error}")

    def submit_failed(self, command: StageSubmit, exc: BaseException) -> None:
        """``stages[command.stage_id].submit(...)`` raised ``exc``: end that request."""
        st = self._requests.get(command.request_id)
        if st is None or st.seq != command.seq:
            logger.debug(
                "stage %d submit for ended request %r failed: %s",
                command.stage_id,
                command.request_id,
                describe(exc),
            )
            return
        label = self.stage_labels[command.stage_id]
        self._fail(st, command.stage_id, f"{label} submit raised {describe(exc)}")

    def stage_died(self, stage_id: int, reason: str) -> None:
        """Stage ``stage_id`` is gone for good (its outputs ended, or reading them failed).

        Every in-flight request that still needs it (it is on the request's route
        and has not finished it) ends with an ``"error"`` terminal; later
        requests that need it end at admission. Other requests are untouched. Each of
        those terminals says ``<stage> died: <reason>``, e.g. ``stage 0 (thinker)
        died: exited with status 3``.
        """
        if self.stage_deaths[stage_id] is not None:
            return
        self.stage_deaths[stage_id] = reason
        for fence in [fence for fence in self._fences if fence[1] == stage_id]:
            del self._fences[fence]  # no more outputs, and no fences, come from it
        message = self._death_message(stage_id)
        for st in list(self._requests.values()):
            if stage_id in st.route.stages and stage_id not in st.finished:
                self._fail(st, stage_id, message)

    def expire(self) -> None:
        """The watchdog: end requests with a stage silent for ``stage_idle_timeout``.

        A submitted stage that has not finished a request and has sent nothing for it
        (since it was submitted, or since its last output) for that long ends the
        request with an ``"error"`` terminal. Call it at :meth:`next_deadline`.
        """
        timeout = self.stage_idle_timeout
        now = self.now
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, seq, sid, request_id = heapq.heappop(timers)
            st = self._requests.get(request_id)
            if st is None or st.seq != seq or sid in st.finished:
                continue
            assert timeout is not None
            deadline = st.last_heard[sid] + timeout
            if deadline > now:  # heard from since: re-arm
                heapq.heappush(timers, (deadline, seq, sid, request_id))
                continue
            label = self.stage_labels[sid]
            self._fail(st, sid, f"{label} sent nothing for {timeout:g} s (stage_idle_timeout)")

    def fail(self, request_id: str, stage_id: int, message: str) -> bool:
        """End ``request_id`` now with an ``"error"`` terminal saying ``message``
        (naming ``stage_id``), as a failing stage would; a no-op (returning ``False``)
        if it is not in flight. A driver's own reasons end requests this way: its
        consumer stopped reading (``consumer_idle_timeout``), say."""
        st = self._requests.get(request_id)
        if st is None:
            return False
        self._fail(st, stage_id, message)
        return True

    def abort(self, request_id: str) -> bool:
        """End ``request_id`` now; a no-op (returning ``False``) if it is not in flight.

        Every live stage submitted for the request that has not finished it gets a
        :class:`StageAbort` (every one its :class:`StageRelease`). The user
        gets one ``"aborted"`` terminal -- unless every final stage had already finished and
        the terminal was only held for a straggler: then the held ``"completed"``
        terminal (which carries the last final data) is released instead.
        """
        st = self._requests.get(request_id)
        if st is None:
            return False
        terminal = st.pending_final
        if terminal is None:
            last = st.last_stage
            terminal = OrchOutput(
                request_id, last, None, True, "aborted", output_type=self.output_types[last]
            )
        self._abort_stages(st)
        self._end(st, terminal)
        return True

    def abort_all(self) -> None:
        """Abort every in-flight request (shutdown)."""
        for request_id in list(self._requests):
            self.abort(request_id)

    # -- internals -------------------------------------------------------------------

    def _submit(self, st: ReqState, stage_id: int, stage_input: Any) -> None:
        st.submitted.add(stage_id)
        st.submit_times[stage_id] = self.now
        request = StageRequest(st.request_id, stage_input, st.seq, st.route, st.priority)
        self._commands.append(StageSubmit(stage_id, request))
        if self.stage_idle_timeout is not None:
            st.last_heard[stage_id] = self.now
            deadline = self.now + self.stage_idle_timeout
            heapq.heappush(self._timers, (deadline, st.seq, stage_id, st.request_id))

    def _forward(self, st: ReqState, stage_id: int) -> None:
        """``stage_id`` finished ``st``: submit each stage that reads it on the route
        and now has every input it reads there (a join waits for its last)."""
        input_fn = self._input_fn
        assert input_fn is not None
        route = st.route
        finished = st.finished
        for nxt in route.outputs[stage_id]:
            sources = route.inputs[nxt]
            if not finished.issuperset(sources):
                continue  # a join: an input is still running
            outputs = {src: st.forward_data.get(src, []) for src in sources}
            try:
                stage_input = input_fn(nxt, outputs)
            except Exception as exc:
                name = self._input_fn_name
                if len(sources) == 1:
                    where = f"from stage {sources[0]} to stage {nxt}"
                else:
                    where = f"for stage {nxt} (reading stages {list(sources)})"
                message = f"{name} {where} raised {describe(exc)}"
                self._fail(st, nxt, message)
                return
            self._submit(st, nxt, stage_input)
            for src in sources:  # forget what no stage will read any more
                if all(reader in st.submitted for reader in route.outputs[src]):
                    st.forward_data.pop(src, None)
                    if st.forward_sizes is not None:
                        st.forward_bytes -= st.forward_sizes.pop(src, 0)

    def _death_message(self, stage_id: int) -> str:
        return f"{self.stage_labels[stage_id]} died: {self.stage_deaths[stage_id]}"

    def _error(self, st: ReqState, stage_id: int, message: str) -> OrchOutput:
        return OrchOutput(
            st.request_id,
            stage_id,
            None,
            True,
            "error",
            message,
            output_type=self.output_types[stage_id],
        )

    def _fail(self, st: ReqState, stage_id: int, message: str) -> None:
        """End an in-flight request because of an error at ``stage_id``."""
        terminal = st.pending_final
        if terminal is None:
            terminal = self._error(st, stage_id, message)
        else:
            # Every final stage already finished: the user's result is complete, so
            # the held "completed" terminal (with its data) goes out instead.
            logger.warning(
                "request %r: %s after its final stages finished; it completes",
                st.request_id,
                message,
            )
        self._abort_stages(st)
        self._end(st, terminal)

    def _live_submitted(self, st: ReqState) -> list[int]:
        """The stages ``st`` was submitted to that are still alive, in order."""
        return [sid for sid in sorted(st.submitted) if self.stage_deaths[sid] is None]

    def _abort_stages(self, st: ReqState) -> None:
        """Abort every live stage still running ``st`` (one that finished it has
        nothing to stop: its release follows, with the others')."""
        done = st.finished
        rid = st.request_id
        self._commands.extend(
            StageAbort(sid, rid) for sid in self._live_submitted(st) if sid not in done
        )

    def _end(self, st: ReqState, terminal: OrchOutput) -> None:
        """Emit the request's terminal output, with its metrics, and forget the request."""
        if self._requests.get(st.request_id) is st:
            del self._requests[st.request_id]
        live = self._live_submitted(st)
        self._commands.extend(StageRelease(sid, st.request_id) for sid in live)
        for sid in self._fenced.intersection(live):
            fence = (st.request_id, sid)
            self._fences[fence] = self._fences.get(fence, 0) + 1
        st.num_outputs += 1
        if terminal.finish_reason == "completed":
            self.completed += 1
            st.first_output.setdefault(terminal.stage_id, self.now)
        elif terminal.finish_reason == "aborted":
            self.aborted += 1
        else:
            self.errored += 1
        metrics = RequestMetrics(
            arrival_time=st.arrival,
            terminal_time=self.now,
            first_output_times=st.first_output,
            stage_finish_times=st.finish_times,
            num_outputs=st.num_outputs,
            stage_submit_times=st.submit_times,
        )
        self._outputs.append(msgspec.structs.replace(terminal, metrics=metrics))

    def _lift_fence(self, request_id: str, stage_id: int) -> None:
        """Stage ``stage_id``'s outputs of an ended ``request_id`` are over."""
        fence = (request_id, stage_id)
        left = self._fences.get(fence, 0) - 1
        if left > 0:
            self._fences[fence] = left
        else:
            self._fences.pop(fence, None)

    @property
    def fences(self) -> int:
        """Fences still to come (see :attr:`StageOutput.released`)."""
        return len(self._fences)

    def _drop(self, stage_id: int, output: object, why: str, *, level: int = logging.DEBUG) -> None:
        self.dropped_outputs += 1
        if logger.isEnabledFor(level):
            logger.log(level, "dropped an output of stage %d (%r): %s", stage_id, output, why)


#: Routes a core keeps (a pipeline has few; past this many, they are computed afresh).
_MAX_ROUTES = 256


def _from_forward_fn(forward_fn: ForwardFn) -> InputFn:
    """``forward_fn`` as an :data:`InputFn`: a stage reading one stage gets
    ``forward_fn(that_stage, its_outputs)``; a join gets that per input, by index."""

    def input_fn(stage_id: int, outputs: dict[int, list[Any]]) -> Any:
        if len(outputs) == 1:
            ((src, data),) = outputs.items()
            return forward_fn(src, data)
        return {src: forward_fn(src, data) for src, data in outputs.items()}

    return input_fn
