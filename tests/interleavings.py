"""Random pipelines and random interleavings of their stages, with the seed's invariants.

One scenario runner drives either the pure core (``CoreHarness``, loop-free: its
coroutine never suspends and is stepped by hand) or the Trio orchestrator
(``TrioHarness``). Hypothesis picks the pipeline, each request's script, and at every
step what happens next: a stage output, a late ("junk") output that must be dropped,
an error, an abort, or a settle point where the test looks at what the user got.

Invariants (checked at every settle point and at the end):
  * each request gets at most one terminal and it is its last output; at the end,
    exactly one;
  * a "completed" terminal is only seen once every submitted stage has finished;
    once they all have, it has been seen (no lost or late-held terminal);
  * final stages' data reaches the user in order, complete for completed requests;
  * no data from a non-final stage reaches the user;
  * late outputs are dropped and counted, and nothing is resurrected.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import attrs
from hypothesis import strategies as st

from omni_trio import OrchOutput, StageOutput
from omni_trio._core import OrchestratorCore, StageRelease, StageSubmit


@attrs.frozen
class Pipeline:
    num_stages: int
    finals: frozenset[int]
    mode: str

    @property
    def last(self) -> int:
        return max(self.finals)

    def functions(self) -> dict[str, Callable[..., Any]]:
        if self.mode == "forward":
            return {"forward_fn": lambda sid, outs: ("fwd", sid, tuple(outs))}
        return {"prewarm_fn": lambda sid, prompt: ("warm", sid, prompt)}


@st.composite
def pipelines(draw: st.DrawFn) -> Pipeline:
    n = draw(st.integers(2, 5))
    finals = draw(st.frozensets(st.integers(0, n - 1), min_size=1))
    return Pipeline(n, finals, draw(st.sampled_from(["async_chunk", "forward"])))


@st.composite
def scripts(draw: st.DrawFn, pipeline: Pipeline) -> dict[str, dict[int, list[StageOutput]]]:
    """Per request, per submitted stage: the outputs it will send, finish last."""
    result: dict[str, dict[int, list[StageOutput]]] = {}
    for r in range(draw(st.integers(1, 4))):
        rid = f"r{r}"
        result[rid] = {}
        for k in range(pipeline.last + 1):
            items = [StageOutput(rid, f"{rid}.{k}.{i}") for i in range(draw(st.integers(0, 3)))]
            end = draw(st.sampled_from([None, f"{rid}.{k}.end"]))
            result[rid][k] = [*items, StageOutput(rid, end, finished=True)]
    return result


class CoreHarness:
    """Drives the pure core; commands become 'submitted' at settle points."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.core = OrchestratorCore(pipeline.num_stages, pipeline.finals, **pipeline.functions())
        self.submitted: set[tuple[str, int]] = set()
        self.releases: dict[int, list[str]] = defaultdict(list)

    async def add(self, rid: str) -> None:
        self.core.add_request(rid, f"prompt of {rid}")

    def is_submitted(self, rid: str, k: int) -> bool:
        return (rid, k) in self.submitted

    def emit(self, k: int, output: StageOutput) -> None:
        self.core.receive_output(k, output)

    async def abort(self, rid: str) -> None:
        self.core.abort(rid)

    async def settle(self) -> list[OrchOutput]:
        for command in self.core.take_commands():
            if isinstance(command, StageSubmit):
                self.submitted.add((command.request_id, command.stage_id))
            elif isinstance(command, StageRelease):
                self.releases[command.stage_id].append(command.request_id)
        return self.core.take_outputs()

    def released(self, k: int) -> list[str]:
        return self.releases[k]

    def stats(self) -> tuple[int, int, int, int, int, int]:
        c = self.core
        return (c.in_flight, c.admitted, c.completed, c.aborted, c.errored, c.dropped_outputs)


class OrchestratorHarness:
    """Drives a running orchestrator (Trio or its asyncio twin) over scripted stages."""

    def __init__(self, fw: Any, orch: Any, stages: list[Any]) -> None:
        self.fw = fw
        self.orch = orch
        self.stages = stages

    async def add(self, rid: str) -> None:
        await self.orch.add_request(rid, f"prompt of {rid}")

    def is_submitted(self, rid: str, k: int) -> bool:
        return rid in self.stages[k].submitted_ids()

    def emit(self, k: int, output: StageOutput) -> None:
        # No checkpoint: everything emitted before a settle point is read in batches.
        self.stages[k].emit_nowait(output.request_id, output.data, output.finished, output.error)

    async def abort(self, rid: str) -> None:
        await self.orch.abort(rid)

    async def settle(self) -> list[OrchOutput]:
        return await self.fw.collect_outputs(self.orch)  # type: ignore[no-any-return]

    def released(self, k: int) -> list[str]:
        return self.stages[k].releases  # type: ignore[no-any-return]

    def stats(self) -> tuple[int, int, int, int, int, int]:
        s = self.orch.statistics()
        return (s.in_flight, s.admitted, s.completed, s.aborted, s.errored, s.dropped_outputs)


STEP_KINDS = ["emit"] * 8 + ["settle"] * 3 + ["junk", "error", "abort"]


async def run_scenario(
    harness: CoreHarness | OrchestratorHarness,
    pipeline: Pipeline,
    script: dict[str, dict[int, list[StageOutput]]],
    draw: Callable[[st.SearchStrategy[Any]], Any],
    *,
    faults: bool = True,
) -> None:
    last = pipeline.last
    todo = {(rid, k): deque(outs) for rid, stages in script.items() for k, outs in stages.items()}
    emitted: dict[tuple[str, int], list[Any]] = defaultdict(list)
    finished_in: dict[tuple[str, int], int] = {}  # settle round in which a finish went out
    ended: dict[str, tuple[Any, ...]] = {}  # requests we errored/aborted: how
    seen: dict[str, list[OrchOutput]] = defaultdict(list)
    terminal_round: dict[str, int] = {}
    junk = 0
    rounds = 0

    for rid in script:
        await harness.add(rid)

    def done_stages(rid: str) -> bool:
        return all((rid, k) in finished_in for k in range(last + 1))

    async def settle() -> None:
        nonlocal rounds
        for out in await harness.settle():
            rid = out.request_id
            assert rid not in terminal_round, f"{out} after the terminal of {rid}"
            seen[rid].append(out)
            if out.finished:
                terminal_round[rid] = rounds
                if out.finish_reason == "completed":
                    # Held until every stage finished -- or released early by an error
                    # or abort that came after every final stage had finished.
                    released = ended.get(rid, (None, None, False))[2]
                    assert done_stages(rid) or released, f"{out}: terminal came early"
            else:
                assert out.finish_reason is None
                assert out.stage_id in pipeline.finals, f"{out}: non-final data reached the user"
        for rid in script:
            if rid not in ended and done_stages(rid):
                assert rid in terminal_round, f"{rid}: every stage finished but no terminal"
        for k in range(pipeline.num_stages):  # nothing is freed before the terminal
            early = set(harness.released(k)) - set(terminal_round)
            assert not early, f"stage {k} released {early} before their terminal"
        rounds += 1

    def emittable() -> list[tuple[str, int]]:
        return [
            (rid, k)
            for (rid, k), q in todo.items()
            if q and rid not in ended and rid not in terminal_round and harness.is_submitted(rid, k)
        ]

    while True:
        candidates = emittable()
        kind = draw(st.sampled_from(STEP_KINDS if faults else ["emit", "emit", "settle"]))
        if kind == "settle" or (not candidates and kind == "emit"):
            await settle()
            if not emittable():
                break
            continue
        if kind == "emit":
            rid, k = draw(st.sampled_from(candidates))
            output = todo[rid, k].popleft()
            harness.emit(k, output)
            emitted[rid, k].append(output.data)
            if output.finished:
                finished_in[rid, k] = rounds
        elif kind == "junk":
            # Only outputs that must be dropped whatever the interleaving: after the
            # stage finished (same channel, so in order), beyond last_stage, or for a
            # request that ended before the last settle point.
            targets = (
                [key for key in finished_in]
                + [(rid, k) for rid in script for k in range(last + 1, pipeline.num_stages)]
                + [(rid, k) for rid in terminal_round for k in range(pipeline.num_stages)]
            )
            if not targets:
                continue
            rid, k = draw(st.sampled_from(sorted(targets)))
            finished, error = draw(st.sampled_from([(False, None), (True, None), (False, "late")]))
            harness.emit(k, StageOutput(rid, "junk", finished, error))
            junk += 1
        elif kind == "error" and candidates:
            await settle()  # so that what the error ends is known
            candidates = emittable()
            if not candidates:
                continue
            rid, k = draw(st.sampled_from(candidates))
            harness.emit(k, StageOutput(rid, error=f"boom at {k}"))
            ended[rid] = ("error", k, all((rid, f) in finished_in for f in pipeline.finals))
            await settle()
        elif kind == "abort":
            await settle()
            live = [rid for rid in script if rid not in ended and rid not in terminal_round]
            if not live:
                continue
            rid = draw(st.sampled_from(live))
            await harness.abort(rid)
            ended[rid] = ("abort", None, all((rid, f) in finished_in for f in pipeline.finals))
            await settle()

    # Every request ended exactly once, with the right reason and data.
    for rid in script:
        outs = seen[rid]
        assert sum(o.finished for o in outs) == 1, f"{rid}: {outs}"
        terminal = outs[-1]
        assert terminal.finished
        how = ended.get(rid)
        if how is None or how[2]:
            # Never interrupted, or interrupted after every final stage had finished:
            # the (possibly held) completed terminal is what the user gets.
            assert terminal.finish_reason == "completed", (rid, how, terminal)
        elif how[0] == "error":
            assert (terminal.finish_reason, terminal.stage_id) == ("error", how[1])
            assert terminal.error == f"stage {how[1]} failed: boom at {how[1]}"
        else:
            assert (terminal.finish_reason, terminal.stage_id) == ("aborted", last)
        for k in pipeline.finals:
            got = [
                o.data
                for o in outs
                if o.stage_id == k and o.finish_reason != "error" and o.finish_reason != "aborted"
            ]
            if terminal.finish_reason == "completed":
                assert got == emitted[rid, k], (rid, k)
            else:
                assert got == emitted[rid, k][: len(got)], (rid, k)

    for k in range(pipeline.num_stages):  # every submitted stage, exactly once
        submitted = sorted(rid for rid in script if harness.is_submitted(rid, k))
        assert sorted(harness.released(k)) == submitted, k

    in_flight, admitted, completed, aborted, errored, dropped = harness.stats()
    assert in_flight == 0
    assert admitted == completed + aborted + errored == len(script)
    assert dropped == junk
