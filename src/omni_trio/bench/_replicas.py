"""The replica scenarios: a bottleneck stage of 1, 2, 4 and 8 replicas, and the
speech demo with its talker and code2wav at 1 and 2.

``python -m omni_trio.bench._replicas --part device --batch B [--quick]`` and
``--part speech`` each run in a process of their own and print their results as JSON;
:mod:`omni_trio.bench._replicas_report` runs them, judges the goals and prints the
tables. Only the public API is used: configs and :func:`omni_trio.open_pipeline`.

- ``device``: a two-stage async_chunk pipeline (:data:`DEVICE_TOML`): ``host``, one
  worker with no device time, sends each request's plan (its number of steps) as a
  chunk to ``device``, the bottleneck, whose replicas each have one device of ``B``
  slots and 20 ms steps (:mod:`omni_trio.bench._device`); every request is 10 steps,
  one output each. For each replica count, a warm-up, then, at each concurrency,
  that many clients each running requests back to back until the level's count is
  done: throughput (requests/s over the level's wall time) and each request's first
  output (from entering ``open_request`` to its first output).
- ``speech``: the shipped ``speech`` pipeline (eSpeak NG) in forward mode, at a
  concurrency of 10 (20 requests, at most 10 at once, as ``omni-trio demo`` runs a
  level), with talker and code2wav at 1 replica each, then at 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec
import trio

from .. import open_pipeline
from ..config import PipelineConfig, parse_pipeline, shipped_pipeline
from ..demo.runner import PROMPTS
from ._device import STEP_SECONDS

__all__ = [
    "DEVICE_TOML",
    "Sizes",
    "device_config",
    "main",
    "speech_config",
    "summary",
]

DEVICE_TOML = """
[pipeline]
name = "bench-replicas"
async_chunk = true
connector = "shm"

[[stages]]
stage_id = 0
name = "host"
engine = "omni_trio.bench._device:host"

[[stages]]
stage_id = 1
name = "device"
engine = "omni_trio.bench._device:device"
engine_args = {{ step_seconds = {step_seconds}, batch = {batch} }}
prewarm_func = "omni_trio.bench._chunk_engines:same_input"
final_output = true
[stages.runtime]
replicas = {replicas}
balance = "least_loaded"
"""

#: How long a level may take to hand its requests' counts back before the next.
SETTLE_SECONDS = 5.0


@attrs.frozen
class Sizes:
    """How much each part does."""

    replicas: tuple[int, ...]
    concurrency: tuple[int, ...]
    steps: int
    step_seconds: float
    min_requests: int  # per level; and at least ``per_client`` per client
    per_client: int
    speech_concurrency: int
    speech_requests: int
    speech_replicas: tuple[int, ...]
    speech_thinker: dict[str, Any]  # overrides of the thinker's engine_args

    @classmethod
    def full(cls) -> Sizes:
        return cls((1, 2, 4, 8), (1, 4, 8, 10, 32), 10, STEP_SECONDS, 20, 4, 10, 20, (1, 2), {})

    @classmethod
    def quick(cls) -> Sizes:
        thinker = {"tokens_per_second": 400.0, "max_tokens": 8}
        return cls((1, 2), (1, 2, 10), 3, 0.005, 4, 2, 2, 2, (1, 2), thinker)

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.per_client * concurrency)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, p50, p90 and max of ``values`` (seconds)."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {
        "mean": statistics.fmean(ordered),
        "p50": statistics.median(ordered),
        "p90": p90,
        "max": ordered[-1],
    }


# -- the device-time pipeline ----------------------------------------------------------------


def device_config(sizes: Sizes, *, replicas: int, batch: int) -> PipelineConfig:
    text = DEVICE_TOML.format(step_seconds=sizes.step_seconds, batch=batch, replicas=replicas)
    return parse_pipeline(text, source="bench replicas")


async def _device_request(orch: Any, steps: int) -> dict[str, Any]:
    """One request, read to its end: when its first output came, its end, and what its
    first output says of its worker."""
    started = time.perf_counter()
    first: float | None = None
    found: dict[str, Any] = {}
    outputs = 0
    async with orch.open_request({"steps": steps}) as stream:
        async for out in stream:
            if out.stage_id != 1 or out.data is None:
                continue
            outputs += 1
            if first is None:
                first = time.perf_counter() - started
                found = out.data
    ended = time.perf_counter() - started
    terminal = stream.terminal
    if terminal is None or terminal.finish_reason != "completed" or outputs != steps:
        why = "no terminal" if terminal is None else f"{terminal.finish_reason}: {terminal.error}"
        raise RuntimeError(f"a bench request got {outputs} of {steps} outputs ({why})")
    assert first is not None
    return {"first": first, "e2e": ended, **found}


async def _level(
    orch: Any, concurrency: int, count: int, steps: int
) -> tuple[float, list[dict[str, Any]]]:
    """``concurrency`` clients running ``count`` requests back to back: the wall time,
    and each request's figures."""
    done: list[dict[str, Any]] = []
    left = count

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            done.append(await _device_request(orch, steps))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    return time.perf_counter() - started, done


async def _settle(stage: Any) -> None:
    """Wait until no request is on any replica any more: each level starts from idle
    replicas."""

    def busy() -> bool:
        return any(replica.load for replica in stage.statistics().replicas)

    with trio.move_on_after(SETTLE_SECONDS):
        while busy():  # noqa: ASYNC110 - the stage has no event to wait on
            await trio.sleep(0.005)


def _level_result(
    stage: Any, concurrency: int, wall: float, done: list[dict[str, Any]], batch: int, steps: int
) -> dict[str, Any]:
    pids = [replica.pid for replica in stage.statistics().replicas]
    served = Counter(request["pid"] for request in done)
    return {
        "concurrency": concurrency,
        "requests": len(done),
        "wall": wall,
        "rate": len(done) / wall,
        "outputs_rate": len(done) * steps / wall,
        "first_output": summary([request["first"] for request in done]),
        "e2e": summary([request["e2e"] for request in done]),
        "slot_wait": summary([request["waited"] for request in done]),
        # requests that found their replica's slots all taken, and had to wait
        "queued": sum(request["held"] >= batch for request in done),
        "per_replica": [served.get(pid, 0) for pid in pids],
    }


async def device_part(sizes: Sizes, batch: int) -> dict[str, Any]:
    """Every replica count at every concurrency, one pipeline per replica count."""
    load = os.getloadavg()[0]
    by_replicas: dict[str, Any] = {}
    for replicas in sizes.replicas:
        config = device_config(sizes, replicas=replicas, batch=batch)
        async with open_pipeline(config) as pipeline:
            orch, stage = pipeline.orchestrator, pipeline.stages[1]
            for _ in range(2):  # warm-up: a request on every replica, twice
                await _level(orch, replicas, replicas, sizes.steps)
                await _settle(stage)
            levels = {}
            for concurrency in sizes.concurrency:
                count = sizes.requests(concurrency)
                wall, done = await _level(orch, concurrency, count, sizes.steps)
                levels[str(concurrency)] = _level_result(
                    stage, concurrency, wall, done, batch, sizes.steps
                )
                await _settle(stage)
            restarts = stage.statistics().restarts
        by_replicas[str(replicas)] = {"replicas": replicas, "restarts": restarts, "levels": levels}
    return {
        "batch": batch,
        "steps": sizes.steps,
        "step_seconds": sizes.step_seconds,
        "concurrency": list(sizes.concurrency),
        "requests": {str(c): sizes.requests(c) for c in sizes.concurrency},
        "replicas": by_replicas,
        "load_average": [load, os.getloadavg()[0]],  # 1 minute, before and after
    }


# -- the speech demo ---------------------------------------------------------------------------


def speech_config(replicas: int, thinker_args: dict[str, Any]) -> PipelineConfig:
    """The shipped ``speech`` pipeline in forward mode, talker and code2wav at
    ``replicas`` each."""
    config = shipped_pipeline("speech").with_mode(False)
    thinker, talker, code2wav = config.stages
    thinker = msgspec.structs.replace(thinker, engine_args={**thinker.engine_args, **thinker_args})
    talker, code2wav = (
        msgspec.structs.replace(stage, runtime=attrs.evolve(stage.runtime, replicas=replicas))
        for stage in (talker, code2wav)
    )
    return msgspec.structs.replace(config, stages=[thinker, talker, code2wav])


async def _speech_request(orch: Any, prompt: str, sample_rate: int) -> dict[str, float]:
    pcm = 0
    async with orch.open_request(prompt) as stream:
        async for out in stream:
            if out.stage_id == 2 and isinstance(out.data, bytes):
                pcm += len(out.data)
    terminal = stream.terminal
    if terminal is None or terminal.finish_reason != "completed" or terminal.metrics is None:
        why = "no terminal" if terminal is None else f"{terminal.finish_reason}: {terminal.error}"
        raise RuntimeError(f"a speech request did not complete ({why})")
    metrics = terminal.metrics
    first_text, first_audio = metrics.time_to_first_output(0), metrics.time_to_first_output(2)
    if first_text is None or first_audio is None:
        raise RuntimeError("a speech request completed without text or audio")
    return {
        "ttft": first_text,
        "ttfp": first_audio,
        "e2e": metrics.e2e_latency,
        "audio": pcm / 2 / sample_rate,
    }


async def _speech_level(
    orch: Any, sizes: Sizes, sample_rate: int
) -> tuple[float, list[dict[str, float]]]:
    """``speech_requests`` requests, started in order, at most ``speech_concurrency``
    at once: the wall time, and each request's figures."""
    done: list[dict[str, float]] = []
    slots = trio.Semaphore(sizes.speech_concurrency)

    async def request(index: int) -> None:
        try:
            prompt = PROMPTS[index % len(PROMPTS)]
            done.append(await _speech_request(orch, prompt, sample_rate))
        finally:
            slots.release()

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(sizes.speech_requests):
            await slots.acquire()
            nursery.start_soon(request, index)
    return time.perf_counter() - started, done


async def speech_part(sizes: Sizes) -> dict[str, Any]:
    """The speech demo in forward mode at ``speech_concurrency``, for each replica count
    of talker and code2wav."""
    load = os.getloadavg()[0]
    runs = {}
    for replicas in sizes.speech_replicas:
        config = speech_config(replicas, sizes.speech_thinker)
        sample_rate = config.stages[2].sample_rate
        async with open_pipeline(config) as pipeline:
            orch = pipeline.orchestrator
            await _speech_request(orch, PROMPTS[0], sample_rate)  # warm-up: eSpeak NG loads
            wall, done = await _speech_level(orch, sizes, sample_rate)
        runs[str(replicas)] = {
            "replicas": replicas,
            "requests": len(done),
            "wall": wall,
            "rate": len(done) / wall,
            **{key: summary([each[key] for each in done]) for key in ("ttft", "ttfp", "e2e")},
            "audio_seconds": statistics.fmean(each["audio"] for each in done),
        }
    return {
        "mode": "forward",
        "concurrency": sizes.speech_concurrency,
        "requests": sizes.speech_requests,
        "replicas": runs,
        "load_average": [load, os.getloadavg()[0]],  # 1 minute, before and after
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench._replicas")
    parser.add_argument("--part", choices=["device", "speech"], required=True)
    parser.add_argument("--batch", type=int, default=1, help="the device's slots per replica")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes.full()
    if args.part == "device":
        found = trio.run(device_part, sizes, args.batch)
    else:
        found = trio.run(speech_part, sizes)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
