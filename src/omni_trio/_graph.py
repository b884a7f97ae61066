"""Stage graphs and request routes: which stage reads which, and the stages one
request runs.

A pipeline's stages form a directed acyclic graph (:class:`StageGraph`): each stage
reads the outputs of its *inputs* (``engine_input_source`` in a config), several
stages may read one (fan-out), and one stage may read several (fan-in, a join).
Stages that read none are the graph's *sources*: a request enters there unless it
says otherwise.

A request runs a :class:`Route`: its *entries* (the stages that get its prompt), its
*finals* (the stages whose outputs reach its user) and every stage on some path from
an entry to a final. An entry reads nothing on the route, even where the graph gives
it inputs: its input is the prompt. Stages off the route are never submitted.

Pure data, no trio or asyncio: the core computes a request's route at admission
(and caches it: a pipeline has few distinct routes), and everything downstream
reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

__all__ = ["Route", "StageGraph", "stage_ids"]


def stage_ids(name: str, value: object, num_stages: int) -> frozenset[int]:
    """``value`` as a set of stage indexes of a ``num_stages``-stage pipeline.

    Raises:
      TypeError: not a collection of ints.
      ValueError: empty, or naming a stage that does not exist.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a collection of stage indexes, got {value!r}")
    ids = frozenset(value)
    if not ids:
        raise ValueError(f"{name} must name at least one stage")
    for sid in sorted(ids, key=repr):
        if not isinstance(sid, int) or isinstance(sid, bool):
            raise TypeError(f"{name} must hold stage indexes (int), got {sid!r}")
        if not 0 <= sid < num_stages:
            raise ValueError(
                f"{name} contains {sid}, but the pipeline has {num_stages} "
                f"stage{'s' if num_stages != 1 else ''} (valid indexes: 0..{num_stages - 1})"
            )
    return ids


@attrs.frozen
class Route:
    """The stages one request runs, and the edges between them.

    Attributes:
      entries: The stages that get the request's prompt.
      finals: The stages whose outputs reach the request's user.
      stages: Every stage on some path from an entry to a final, in topological
          order (an input before the stages that read it).
      inputs: Per stage index of the pipeline, the stages it reads on this route
          (empty for an entry, and for a stage off the route).
      outputs: Per stage index, the stages that read it on this route.
    """

    entries: frozenset[int]
    finals: frozenset[int]
    stages: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    last_stage: int = attrs.field(init=False, eq=False)
    """``max(finals)``: the stage an ``"aborted"`` terminal names."""

    @last_stage.default
    def _last_stage(self) -> int:
        return max(self.finals)

    def __contains__(self, stage_id: object) -> bool:
        return stage_id in self.stages

    def describe(self) -> str:
        """``0 -> 1 -> 2`` for a line, else ``entries [0] finals [2] via [0, 1, 2]``."""
        line = all(
            len(self.inputs[sid]) == (sid != self.stages[0]) and len(self.outputs[sid]) <= 1
            for sid in self.stages
        )
        if line:
            return " -> ".join(map(str, self.stages))
        return (
            f"entries {sorted(self.entries)} finals {sorted(self.finals)} via {list(self.stages)}"
        )


@attrs.frozen
class StageGraph:
    """Which stage reads which: a directed acyclic graph over stage indexes.

    Build one with :meth:`of` (checked) or :meth:`linear`.

    Attributes:
      inputs: Per stage, the stages it reads, ascending.
      outputs: Per stage, the stages that read it, ascending.
      order: Every stage, in a topological order (ties by index).
      sources: The stages that read none: a request's default entries.
    """

    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    sources: frozenset[int]

    @classmethod
    def linear(cls, num_stages: int) -> StageGraph:
        """Stage ``k`` reads stage ``k - 1``: the line every pipeline used to be."""
        return cls.of([[sid - 1] if sid else [] for sid in range(num_stages)])

    @classmethod
    def of(cls, inputs: Sequence[Iterable[int]]) -> StageGraph:
        """The graph in which stage ``k`` reads the stages ``inputs[k]``.

        Raises:
          TypeError: ``inputs[k]`` is not a collection of ints.
          ValueError: no stage, an unknown stage index, a stage reading itself, or a
              cycle (named, ``1 -> 2 -> 1``).
        """
        n = len(inputs)
        if n < 1:
            raise ValueError("a stage graph needs at least one stage")
        ins: list[tuple[int, ...]] = []
        for sid, sources in enumerate(inputs):
            name = f"the inputs of stage {sid}"
            if isinstance(sources, (str, bytes)) or not isinstance(sources, Iterable):
                raise TypeError(f"{name} must be a collection of stage indexes, got {sources!r}")
            got = list(sources)
            ids = stage_ids(name, got, n) if got else frozenset()
            if sid in ids:
                raise ValueError(f"stage {sid} reads itself ({name}: {sorted(ids)})")
            ins.append(tuple(sorted(ids)))
        outs: list[list[int]] = [[] for _ in range(n)]
        for sid, sources in enumerate(ins):
            for src in sources:
                outs[src].append(sid)
        order = _toposort(ins, outs)
        return cls(
            tuple(ins),
            tuple(tuple(o) for o in outs),
            order,
            frozenset(sid for sid in range(n) if not ins[sid]),
        )

    @property
    def num_stages(self) -> int:
        return len(self.inputs)

    @property
    def is_linear(self) -> bool:
        """Whether stage ``k`` reads exactly stage ``k - 1`` (and stage 0 none)."""
        return all(ins == ((sid - 1,) if sid else ()) for sid, ins in enumerate(self.inputs))

    def route(
        self,
        entries: Iterable[int] | None = None,
        finals: Iterable[int] | None = None,
        *,
        allowed_finals: frozenset[int] | None = None,
    ) -> Route:
        """The route from ``entries`` to ``finals``.

        With ``entries=None``, the entries are the graph's sources that lead to the
        finals; with ``finals=None``, the finals are those of ``allowed_finals``
        (``None``: every stage) that the entries reach.

        Raises:
          TypeError: not collections of stage indexes.
          ValueError: an empty collection, an unknown stage, a final not in
              ``allowed_finals``, a final that no entry reaches, or an entry that
              reaches no final.
        """
        n = self.num_stages
        ins = self.sources if entries is None else stage_ids("entry_stage_ids", entries, n)
        outs = None if finals is None else stage_ids("final_stage_ids", finals, n)
        if outs is not None and allowed_finals is not None and not outs <= allowed_finals:
            raise ValueError(
                f"a request's final_stage_ids must be a subset of the pipeline's final "
                f"stages {sorted(allowed_finals)}, got {sorted(outs)}"
            )
        # Forward from the entries, never into another entry (its input is the prompt).
        reached = set(ins)
        todo = list(ins)
        while todo:
            for nxt in self.outputs[todo.pop()]:
                if nxt not in reached and nxt not in ins:
                    reached.add(nxt)
                    todo.append(nxt)
        if outs is None:
            candidates = frozenset(range(n)) if allowed_finals is None else allowed_finals
            outs = frozenset(reached & candidates)
            if not outs:
                raise ValueError(
                    f"no final stage is reachable from entry_stage_ids {sorted(ins)} "
                    f"(final stages: {sorted(candidates)})"
                )
        unreached = sorted(outs - reached)
        if unreached:
            raise ValueError(
                f"final {_stages(unreached)} {'are' if len(unreached) > 1 else 'is'} not "
                f"reachable from entry_stage_ids {sorted(ins)}"
            )
        # Backward from the finals, within what the entries reach.
        useful = set(outs)
        todo = list(outs)
        while todo:
            sid = todo.pop()
            if sid in ins:
                continue
            for src in self.inputs[sid]:
                if src in reached and src not in useful:
                    useful.add(src)
                    todo.append(src)
        idle = sorted(ins - useful)
        if idle and entries is None:  # sources with nothing to do for these finals
            ins = ins & useful
        elif idle:
            raise ValueError(
                f"entry {_stages(idle)} reach{'' if len(idle) > 1 else 'es'} none of "
                f"the final stages {sorted(outs)}"
            )
        route_ins = tuple(
            ()
            if sid in ins or sid not in useful
            else tuple(src for src in self.inputs[sid] if src in useful)
            for sid in range(n)
        )
        route_outs: list[list[int]] = [[] for _ in range(n)]
        for sid, sources in enumerate(route_ins):
            for src in sources:
                route_outs[src].append(sid)
        return Route(
            ins,
            outs,
            tuple(sid for sid in self.order if sid in useful),
            route_ins,
            tuple(tuple(o) for o in route_outs),
        )


def _stages(ids: list[int]) -> str:
    return f"stage {ids[0]}" if len(ids) == 1 else f"stages {ids}"


def _toposort(ins: Sequence[tuple[int, ...]], outs: Sequence[list[int]]) -> tuple[int, ...]:
    """Kahn's algorithm, smallest index first; a cycle is a ``ValueError`` naming it."""
    missing = [len(sources) for sources in ins]
    ready = [sid for sid, m in enumerate(missing) if m == 0]
    order: list[int] = []
    while ready:
        ready.sort(reverse=True)
        sid = ready.pop()
        order.append(sid)
        for nxt in outs[sid]:
            missing[nxt] -= 1
            if missing[nxt] == 0:
                ready.append(nxt)
    if len(order) < len(ins):
        raise ValueError(f"the stages form a cycle: {_cycle(ins, set(order))}")
    return tuple(order)


def _cycle(ins: Sequence[tuple[int, ...]], done: set[int]) -> str:
    """One cycle among the stages not in ``done``, as ``1 -> 2 -> 1``."""
    sid = min(s for s in range(len(ins)) if s not in done)
    path: list[int] = []
    seen: dict[int, int] = {}
    while sid not in seen:
        seen[sid] = len(path)
        path.append(sid)
        sid = next(src for src in ins[sid] if src not in done)
    cycle = path[seen[sid] :][::-1]  # walked against the edges: reverse it
    first = cycle.index(min(cycle))
    cycle = cycle[first:] + cycle[:first]
    return " -> ".join(map(str, [*cycle, cycle[0]]))
