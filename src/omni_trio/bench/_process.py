"""The process scenarios: the process data plane, and the floors it is held to.

``python -m omni_trio.bench._process --family NAME [--quick]`` runs one family of
scenarios in a process of its own (so that its peak memory is its own) and prints its
results as JSON; :mod:`omni_trio.bench._process_report` runs every family and
judges the goals. Only the public API is used -- configs and
:func:`omni_trio.open_pipeline` -- so the scenarios measure whatever the data plane is.

- ``chunks``: stage 0 of a two-stage pipeline (worker processes) streams chunks of 64
  B, 4 KB, 48 KB and 1 MB to stage 1, which yields one small output per chunk to the
  orchestrator. Each size runs a warm-up, then ``paced`` chunks one per millisecond
  (the hop's latency: from the sender's stamp to the reader's ``async for``), then
  ``flood`` chunks back to back (chunks/s: from the first chunk's stamp to the
  reader's completion reaching the orchestrator). Alternating with the same phases
  between two bare processes over a socket pair (:mod:`omni_trio.bench._floor`), and,
  for 1 MB chunks, through a shared-memory area of 4 slots too.
- ``control``: one stage's outputs, small, reaching the orchestrator: paced (the
  latency from the engine's yield to the request's consumer) and flooded
  (outputs/s), alternating with small frames from a bare process over a socket pair.
- ``graph``: a join's hop against a line's. Two senders (worker processes) each
  stream 4 KB chunks, paced and flooded as in ``chunks``, to one joiner, which reads
  both as they come (``io.chunks()``); alternating with the ``chunks`` pipeline's
  line, same size and phases. Paced, the two senders tick half an interval apart
  (``join``), then in step (``join_in_step``: each pair arrives at once), and the
  second sends nothing (``join_one_sending``: the join's own path); a line's reader
  takes two streams at once too (``line_two_streams``: two requests, half an
  interval apart). Then requests that enter at the first sender alone: the second,
  routed past, must hear nothing of them (its ``submitted`` count and its worker's
  tables).
- ``demo``: the demo pipeline (thinker -> talker -> code2wav) with pacing off, at
  ``--concurrency`` concurrent requests: wall time, outputs/s, every process's peak
  RSS (VmHWM), /dev/shm bytes under the pipeline's prefix (sampled every 10 ms, and
  what is left once its requests are done and once it is closed).

Each timed figure is the best of the family's rounds (noisy machines): the lowest
latency, the highest rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec
import trio

from .. import open_pipeline
from ..config import PipelineConfig, parse_pipeline, shipped_pipeline
from ._floor import Phase, floor_chunks, floor_outputs

__all__ = ["DEMO_LEVELS", "SIZES", "Counts", "main", "run_family"]

#: Chunk sizes of the ``chunks`` family; the last is compared with the shm floor too.
SIZES = [64, 4096, 48 * 1024, 1024 * 1024]
#: Chunks of at least this many bytes are also measured against the shm floor.
SHM_FLOOR_FROM = 1024 * 1024
#: Slots of the shm floor's area: a small window, so it is a fair pipeline.
SHM_WINDOW = 4
#: Concurrent requests of the ``demo`` family's runs (``--quick``: smaller).
DEMO_LEVELS = (100, 1000)
QUICK_DEMO_LEVELS = (10, 40)
#: /dev/shm is sampled this often during a demo run (seconds).
SHM_SAMPLE_PERIOD = 0.01
#: Pacing "off": the demo engines sleep 1 / this per token / code.
UNPACED = 1e9

CHUNKS_TOML = """
[pipeline]
name = "bench-chunks"
async_chunk = true
connector = "shm"

[[stages]]
stage_id = 0
name = "sender"
engine = "omni_trio.bench._chunk_engines:chunk_sender"

[[stages]]
stage_id = 1
name = "reader"
engine = "omni_trio.bench._chunk_engines:chunk_reader"
prewarm_func = "omni_trio.bench._chunk_engines:same_input"
final_output = true
"""

GRAPH_TOML = """
[pipeline]
name = "bench-graph"
async_chunk = true
connector = "shm"

[[stages]]
stage_id = 0
name = "sender"
engine = "omni_trio.bench._chunk_engines:chunk_sender"

[[stages]]
stage_id = 1
name = "sender2"
engine = "omni_trio.bench._chunk_engines:chunk_sender"
engine_input_source = []

[[stages]]
stage_id = 2
name = "joiner"
engine = "omni_trio.bench._chunk_engines:chunk_joiner"
engine_input_source = [0, 1]
prewarm_func = "omni_trio.bench._chunk_engines:same_input"
final_output = true
"""

CONTROL_TOML = """
[pipeline]
name = "bench-control"
async_chunk = false
connector = "none"

[[stages]]
stage_id = 0
name = "source"
engine = "omni_trio.bench._chunk_engines:output_source"
final_output = true
"""


@attrs.frozen
class Counts:
    """How much each family does."""

    rounds: int
    warm: int
    paced: int
    interval: float
    flood: dict[int, int]  # by chunk size
    outputs_flood: int
    demo_tokens: int
    routed_past: int = 100

    @classmethod
    def full(cls) -> Counts:
        flood = {64: 20_000, 4096: 20_000, 48 * 1024: 5_000, 1024 * 1024: 500}
        return cls(3, 100, 1_000, 0.001, flood, 20_000, 40, 100)

    @classmethod
    def quick(cls) -> Counts:
        flood = {64: 200, 4096: 200, 48 * 1024: 100, 1024 * 1024: 20}
        return cls(1, 10, 20, 0.001, flood, 200, 8, 5)

    def phases(self, flood: int) -> list[Phase]:
        return [
            ("warm", self.warm, 0.0),
            ("paced", self.paced, self.interval),
            ("flood", flood, 0.0),
        ]


def summarize(phases: list[dict[str, Any]]) -> dict[str, float]:
    """A run's figures: the paced phase's hop p50 and p99 (seconds), the flood's rate
    (per second)."""
    by_name = {phase["name"]: phase for phase in phases}
    hops = sorted(by_name["paced"]["hops"])
    flood = by_name["flood"]
    return {
        "hop_p50": statistics.median(hops) / 1e9,
        "hop_p99": hops[min(len(hops) - 1, round(0.99 * (len(hops) - 1)))] / 1e9,
        "rate": flood["count"] / ((flood["end"] - flood["first"]) / 1e9),
    }


def best(runs: list[dict[str, float]]) -> dict[str, Any]:
    """The best of ``runs`` for each figure, and the runs themselves."""
    return {
        "hop_p50": min(run["hop_p50"] for run in runs),
        "hop_p99": min(run["hop_p99"] for run in runs),
        "rate": max(run["rate"] for run in runs),
        "rounds": runs,
    }


async def _complete(orch: Any, prompt: Any) -> tuple[Any, int]:
    """Run one request, reading every output; its terminal's data, and when the
    terminal arrived (ns)."""
    async with orch.open_request(prompt) as stream:
        async for out in stream:
            if out.finished:
                end = time.monotonic_ns()
    terminal = stream.terminal
    assert terminal is not None
    if terminal.finish_reason != "completed":
        raise RuntimeError(f"a bench request ended {terminal.finish_reason}: {terminal.error}")
    return terminal.data, end


# -- (a) chunks between two process stages ---------------------------------------------------


async def omni_chunks(orch: Any, size: int, phases: list[Phase]) -> list[dict[str, Any]]:
    results = []
    for name, count, interval in phases:
        task = {"size": size, "count": count, "interval": interval, "hops": name == "paced"}
        data, end = await _complete(orch, task)
        if data["count"] != count:
            raise RuntimeError(f"the reader got {data['count']} of {count} {size}-byte chunks")
        results.append({"name": name, "end": end, **data})  # first, count, hops
    return results


async def chunks(counts: Counts) -> dict[str, Any]:
    """(a): every chunk size between two process stages, and over the floors."""
    runs: dict[int, dict[str, list[dict[str, float]]]] = {size: {} for size in SIZES}
    config = parse_pipeline(CHUNKS_TOML, source="bench chunks")
    async with open_pipeline(config) as pipeline:
        orch = pipeline.orchestrator
        for _ in range(counts.rounds):  # floor, omni, floor, omni, ...
            for size in SIZES:
                phases = counts.phases(counts.flood[size])
                sides = runs[size]
                sides.setdefault("socket", []).append(summarize(await floor_chunks(size, phases)))
                if size >= SHM_FLOOR_FROM:
                    found = await floor_chunks(size, phases, window=SHM_WINDOW)
                    sides.setdefault("shm", []).append(summarize(found))
                sides.setdefault("omni", []).append(
                    summarize(await omni_chunks(orch, size, phases))
                )
    return {
        "counts": {"paced": counts.paced, "flood": counts.flood, "rounds": counts.rounds},
        "sizes": {
            str(size): {side: best(found) for side, found in sides.items()}
            for size, sides in runs.items()
        },
    }


# -- (a') a join's hop against a line's --------------------------------------------------------

#: The ``graph`` family's chunk size.
GRAPH_CHUNK = 4096


async def join_chunks(
    orch: Any, size: int, phases: list[Phase], *, apart: bool = True, alone: bool = False
) -> list[dict[str, Any]]:
    """:func:`omni_chunks` through the join: both senders send each phase (``alone``:
    the second sends nothing, and the joiner reads two sources, one of them quiet).
    Paced, ``apart`` sends the second's chunks half an interval after the first's
    (else the two tick in step, and each pair reaches the joiner at once)."""
    results = []
    for name, count, interval in phases:
        task: dict[str, Any] = {
            "size": size,
            "count": count,
            "interval": interval,
            "hops": name == "paced",
        }
        if interval:  # both keep their phase, from a start shortly ahead
            task["start"] = time.monotonic() + 0.02
            task["offsets"] = {"1": interval / 2 if apart else 0.0}
        if alone:
            task["counts"] = {"1": 0}
        data, end = await _complete(orch, task)
        sent = {0: count} if alone else {0: count, 1: count}
        if data["sources"] != sent:
            raise RuntimeError(f"the joiner got {data['sources']} of {sent} chunks")
        results.append({"name": name, "end": end, **data})
    return results


async def two_streams(orch: Any, size: int, counts: Counts) -> dict[str, float]:
    """A line's reader taking two streams at once, as a join does: two concurrent
    requests through it, paced half an interval apart; their hops together."""
    interval, start = counts.interval, time.monotonic() + 0.05
    hops: list[int] = []

    async def one(offset: float) -> None:
        task = {
            "size": size,
            "count": counts.paced,
            "interval": interval,
            "hops": True,
            "start": start,
            "offsets": {"0": offset},
        }
        data, _ = await _complete(orch, task)
        hops.extend(data["hops"])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, 0.0)
        nursery.start_soon(one, interval / 2)
    hops.sort()
    return {"hop_p50": statistics.median(hops) / 1e9}


async def graph(counts: Counts) -> dict[str, Any]:
    """(a'): a join's hop p50 against a line's, and a stage routed past."""
    runs: dict[str, list[dict[str, float]]] = {
        "line": [],
        "join_one_sending": [],
        "join": [],
        "join_in_step": [],
    }
    line_two: list[float] = []
    phases = counts.phases(counts.flood[GRAPH_CHUNK])
    line_config = parse_pipeline(CHUNKS_TOML, source="bench chunks")
    join_config = parse_pipeline(GRAPH_TOML, source="bench graph")
    async with open_pipeline(line_config) as line, open_pipeline(join_config) as join:
        size, orch = GRAPH_CHUNK, join.orchestrator
        for _ in range(counts.rounds):  # each in turn, every round
            runs["line"].append(summarize(await omni_chunks(line.orchestrator, size, phases)))
            found = await join_chunks(orch, size, phases, alone=True)
            runs["join_one_sending"].append(summarize(found))
            runs["join"].append(summarize(await join_chunks(orch, size, phases)))
            found = await join_chunks(orch, size, phases, apart=False)
            runs["join_in_step"].append(summarize(found))
            line_two.append((await two_streams(line.orchestrator, size, counts))["hop_p50"])
        passed = join.stages[1]
        before = (await passed.refresh_statistics()).submitted
        task = {"size": size, "count": 10, "interval": 0.0, "hops": False}
        for _ in range(counts.routed_past):
            async with orch.open_request(task, entry_stage_ids=[0]) as stream:
                async for _ in stream:
                    pass
            if stream.terminal is None or stream.terminal.finish_reason != "completed":
                raise RuntimeError(f"a request routed past stage 1 ended {stream.terminal}")
        after = await passed.refresh_statistics()
    return {
        "size": GRAPH_CHUNK,
        "counts": {"paced": counts.paced, "flood": counts.flood[GRAPH_CHUNK]},
        **{shape: best(found) for shape, found in runs.items()},
        "line_two_streams": {"hop_p50": min(line_two), "rounds": line_two},
        "routed_past": {
            "requests": counts.routed_past,
            "submitted": after.submitted - before,
            "worker_requests": after.worker_requests,
        },
    }


# -- (b) the control plane: a stage's outputs reaching the orchestrator -----------------------


async def _omni_outputs(orch: Any, phases: list[Phase]) -> list[dict[str, Any]]:
    results = []
    for name, count, interval in phases:
        # Each output's data is the engine's stamp at its yield.
        stamps = []
        async with orch.open_request({"count": count, "interval": interval}) as stream:
            async for out in stream:
                stamps.append((time.monotonic_ns(), out.data))
        terminal = stream.terminal
        assert terminal is not None
        if terminal.finish_reason != "completed" or len(stamps) != count:
            raise RuntimeError(f"{len(stamps)} of {count} outputs: {terminal.error}")
        hops = [arrived - stamp for arrived, stamp in stamps]
        end = stamps[-1][0]
        results.append(
            {"name": name, "first": stamps[0][1], "end": end, "count": count, "hops": hops}
        )
    return results


async def control(counts: Counts) -> dict[str, Any]:
    """(b): a process stage's outputs reaching the orchestrator, and the floor's frames
    reaching this process."""
    runs: dict[str, list[dict[str, float]]] = {"socket": [], "omni": []}
    phases = counts.phases(counts.outputs_flood)
    config = parse_pipeline(CONTROL_TOML, source="bench control")
    async with open_pipeline(config) as pipeline:
        orch = pipeline.orchestrator
        for _ in range(counts.rounds):
            runs["socket"].append(summarize(await floor_outputs(phases)))
            runs["omni"].append(summarize(await _omni_outputs(orch, phases)))
    return {
        "counts": {"paced": counts.paced, "flood": counts.outputs_flood, "rounds": counts.rounds},
        **{side: best(found) for side, found in runs.items()},
    }


# -- (c) the demo pipeline, pacing off ---------------------------------------------------------


def demo_config(tokens: int, inline_chunk_bytes: int | None = None) -> PipelineConfig:
    """The demo's config with pacing off and ``tokens`` text tokens per answer, and no
    limit on requests in flight (and ``inline_chunk_bytes``, if given: 0 sends every
    chunk through the rings)."""
    config = shipped_pipeline("demo").with_pipeline(max_in_flight=None)
    if inline_chunk_bytes is not None:
        config = config.with_pipeline(inline_chunk_bytes=inline_chunk_bytes)
    thinker, talker, code2wav = config.stages
    thinker = msgspec.structs.replace(
        thinker, engine_args={"tokens_per_second": UNPACED, "max_tokens": tokens}
    )
    talker = msgspec.structs.replace(
        talker, engine_args={**talker.engine_args, "codes_per_second": UNPACED}
    )
    return msgspec.structs.replace(config, stages=[thinker, talker, code2wav])


def shm_usage(prefix: str) -> tuple[int, int]:
    """``(entries, bytes)`` of /dev/shm whose names start with ``prefix``."""
    entries = size = 0
    try:
        listing = os.scandir("/dev/shm")
    except FileNotFoundError:  # pragma: no cover - no /dev/shm here
        return 0, 0
    with listing:
        for entry in listing:
            if entry.name.startswith(prefix):
                try:
                    size += entry.stat().st_size
                except FileNotFoundError:  # gone since the listing
                    continue
                entries += 1
    return entries, size


def peak_rss(pid: int | str) -> int | None:
    """A process's peak resident set (VmHWM), in bytes; ``None`` if it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@attrs.define
class _DemoRun:
    outputs: int = 0
    failures: int = 0
    first_failure: str | None = None
    peak_shm: int = 0

    async def request(self, orch: Any, prompt: str) -> None:
        async with orch.open_request(prompt) as stream:
            async for _out in stream:
                self.outputs += 1
        terminal = stream.terminal
        if terminal is None or terminal.finish_reason != "completed":
            self.failures += 1
            if self.first_failure is None:
                why = "no terminal" if terminal is None else terminal.finish_reason
                self.first_failure = f"{why}: {terminal and terminal.error}"

    async def sample_shm(self, prefix: str) -> None:
        while True:
            self.peak_shm = max(self.peak_shm, shm_usage(prefix)[1])
            await trio.sleep(SHM_SAMPLE_PERIOD)


async def demo(
    counts: Counts, concurrency: int, inline_chunk_bytes: int | None = None
) -> dict[str, Any]:
    """(c): ``concurrency`` requests at once through the unpaced demo pipeline."""
    config = demo_config(counts.demo_tokens, inline_chunk_bytes)
    links = len(config.stages) - 1  # one sending worker -> reading worker pair per edge
    run = _DemoRun()
    async with open_pipeline(config) as pipeline:
        prefix = pipeline.prefix
        orch = pipeline.orchestrator
        async with trio.open_nursery() as sampling:
            sampling.start_soon(run.sample_shm, prefix)
            start = time.perf_counter()
            async with trio.open_nursery() as requests:
                for index in range(concurrency):
                    requests.start_soon(run.request, orch, f"Tell me story number {index}.")
            wall = time.perf_counter() - start
            sampling.cancel_scope.cancel()
        run.peak_shm = max(run.peak_shm, shm_usage(prefix)[1])
        rss = {stage.name: peak_rss(stage.pid) if stage.pid else None for stage in pipeline.stages}
        left_open = shm_usage(prefix)
    left_closed = shm_usage(prefix)
    return {
        "concurrency": concurrency,
        "tokens": counts.demo_tokens,
        "wall": wall,
        "outputs": run.outputs,
        "rate": run.outputs / wall,
        "failures": run.failures,
        "first_failure": run.first_failure,
        "peak_rss": {"orchestrator": peak_rss("self"), **rss},
        "peak_shm": run.peak_shm,
        "inline_chunk_bytes": config.pipeline.inline_chunk_bytes,
        "shm_bound": config.pipeline.ring_bytes * links,
        "shm_left_open": {"entries": left_open[0], "bytes": left_open[1]},
        "shm_left_closed": {"entries": left_closed[0], "bytes": left_closed[1]},
    }


# -- running a family --------------------------------------------------------------------------


async def run_family(
    family: str,
    *,
    quick: bool,
    concurrency: int | None = None,
    inline_chunk_bytes: int | None = None,
) -> dict[str, Any]:
    """One family's results (see the module's docstring)."""
    counts = Counts.quick() if quick else Counts.full()
    if family == "chunks":
        return await chunks(counts)
    if family == "control":
        return await control(counts)
    if family == "graph":
        return await graph(counts)
    if family == "demo":
        if concurrency is None:
            raise ValueError("the demo family needs a concurrency")
        return await demo(counts, concurrency, inline_chunk_bytes)
    raise ValueError(f"no such family of process scenarios: {family!r}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench._process")
    parser.add_argument("--family", choices=["chunks", "graph", "control", "demo"], required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", type=int, help="the demo's concurrent requests")
    parser.add_argument(
        "--inline-chunk-bytes", type=int, help="the demo's threshold (0: every chunk in a ring)"
    )
    args = parser.parse_args(argv)
    found = trio.run(
        lambda: run_family(
            args.family,
            quick=args.quick,
            concurrency=args.concurrency,
            inline_chunk_bytes=args.inline_chunk_bytes,
        )
    )
    print(json.dumps(found))


if __name__ == "__main__":
    main()
