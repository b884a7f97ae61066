"""``omni-trio bench --only priority``: what a request's priority buys under
saturation, each figure a ratio within one run.

``python -m omni_trio.bench._priority [--quick] [--part chat|aging]`` prints one JSON
object (both parts, unless ``--part`` names one):

- ``chat``: the shipped ``assistant`` pipeline (Whisper, SmolLM2 on llama.cpp with 4
  slots, one of them reserved for urgent requests, eSpeak NG), served on 127.0.0.1
  in this process (Hypercorn and the orchestrator on this Trio loop, the stages in
  worker processes) and asked with ``httpx``. Its thinker is saturated by 8 long
  streamed chats of priority 10 (stories of up to 200 tokens, temperature 0, each
  client asking the next as soon as one ends), and a short streamed chat of
  priority -10 is timed to its first token, against the same request on the idle
  pipeline; then a spoken question (eSpeak NG's WAV, as ``input_audio``,
  ``modalities`` text and audio) to its first audio delta, idle and under the same
  load. The baseline, *without priority*, is the same on a second server whose
  thinker keeps no slot (``reserved_slots = 0``) and where every request has
  priority 0: the urgent request queues behind the chats.
- ``aging``: the device-time engines (:mod:`omni_trio.bench._device`: ``host`` then
  ``device``, one slot, 20 ms steps) opened with :func:`omni_trio.open_pipeline`. A
  steady stream of urgent one-step requests (priority 0, one every 15 ms: more than
  the slot serves) and, beside it, a low-priority one (priority 2) every 100 ms,
  for 3 s; once with the device's slot aged every 0.25 s, once strict (no aging).
  The low-priority requests' throughput while the stream lasts, and each one's
  wait against its bound: a waiter of priority ``p`` is overtaken only by requests
  of priority ``q < p`` that reach the device within ``(p - q) * aging_s`` of it,
  so it waits at most for the work ahead of it when it arrived, the urgent work
  that arrives within that window, and a step (:func:`bound_of`). The device's own
  outputs say when each request reached it and in which order it took the slot, so
  the overtaking is checked exactly.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import msgspec
import trio
from rich.console import Console
from rich.table import Table

from ._parts import importable, ms, run_part
from ._process_report import show_met
from ._replicas import DEVICE_TOML
from ._served import served, summary

__all__ = [
    "AGING_S",
    "GOALS",
    "P_HIGH",
    "P_LOW",
    "Sizes",
    "bound_of",
    "goals",
    "main",
    "naive_bound_of",
    "print_priority_report",
    "priority_missing",
    "run",
    "run_priority_bench",
]

#: The chats' and the urgent request's priorities on the prioritised server.
LOAD_PRIORITY = 10
URGENT_PRIORITY = -10
#: The system prompt of the load's chats (the assistant's own asks for one short
#: sentence: these should go on).
LOAD_SYSTEM = "You are a helpful assistant who tells long stories."
#: The urgent chats' questions (one each: llama.cpp reuses a slot's cached prompt).
QUESTIONS = tuple(
    f"What is the opposite of {word}?"
    for word in (
        "hot", "up", "big", "fast", "day", "wet", "old", "happy", "loud", "open", "full",
        "early", "light", "hard", "rich", "first", "near", "high", "long", "sweet",
    )
)  # fmt: skip
#: The spoken questions (eSpeak NG's).
SPOKEN = tuple(
    f"What is the capital of {country}?"
    for country in (
        "France", "Spain", "Italy", "Germany", "Japan", "Egypt", "Canada", "Norway",
        "Greece", "Peru", "Kenya", "Chile",
    )
)  # fmt: skip
#: How long the load may take to fill the thinker's slots.
SATURATE_SECONDS = 60.0
#: ``aging``: the urgent stream's and the low-priority requests' priorities.
P_HIGH = 0
P_LOW = 2
#: ``aging``: the device's aging period in the aged run.
AGING_S = 0.25
#: ``aging``: two readings of the worker's clock (the device's and its slots') differ
#: by microseconds: an overtaker this close to the window's edge is not counted late.
CLOCK_SLACK = 1e-3


#: key -> (what, limit, at_most): the goals (``at_most``: the value must be <= the
#: limit; else > it).
GOALS: dict[str, tuple[str, float, bool]] = {
    "priority.urgent_ttft_busy_over_idle": (
        "an urgent chat beside 8 long chats (reserved slot, priority -10 over 10): "
        "first token p50 <= 1.5x idle",
        1.5,
        True,
    ),
    "priority.aging_low_rate": (
        "aging 0.25 s: low-priority requests completed per second under an urgent overload > 0",
        0.0,
        False,
    ),
    "priority.aging_overtaken_late": (
        "aging 0.25 s: low-priority requests overtaken by one that came after its window <= 0",
        0.0,
        True,
    ),
    "priority.aging_wait_over_bound": (
        "aging 0.25 s: the longest low-priority wait, over its bound, <= 1",
        1.0,
        True,
    ),
}


@attrs.frozen
class Sizes:
    """How much each part does.

    Attributes:
      chats: The load: streamed chats at once, each client asking the next as soon
          as one ends.
      load_tokens: Each load chat's ``max_tokens``.
      urgent_tokens: The urgent chat's ``max_tokens``.
      rounds: Urgent chats (and spoken questions) timed, idle and under the load,
          on the prioritised server.
      baseline_rounds: The same on the baseline server (each waits for the load).
      stream_seconds: ``aging``: how long the urgent stream lasts.
      high_interval: ``aging``: an urgent request every this many seconds.
      low_interval: ``aging``: a low-priority request every this many seconds.
      step_seconds: ``aging``: the device's step.
    """

    chats: int
    load_tokens: int
    urgent_tokens: int
    rounds: int
    baseline_rounds: int
    stream_seconds: float
    high_interval: float
    low_interval: float
    step_seconds: float

    @classmethod
    def full(cls) -> Sizes:
        return cls(8, 200, 16, 5, 3, 3.0, 0.015, 0.100, 0.020)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(4, 32, 8, 2, 1, 1.5, 0.015, 0.100, 0.020)


# -- the assistant, served ---------------------------------------------------------------------


def _thinker(config: Any, **changes: Any) -> Any:
    """``config`` with its thinker's ``engine_args`` changed."""
    stages = [
        msgspec.structs.replace(stage, engine_args={**stage.engine_args, **changes})
        if stage.name == "thinker"
        else stage
        for stage in config.stages
    ]
    return msgspec.structs.replace(config, stages=stages)


def _spoken_wav(text: str) -> str:
    """``text`` said by eSpeak NG, as a WAV file in base64."""
    from .._audio import wav_bytes
    from ..speech import ESpeak

    speech = ESpeak.get()
    return base64.b64encode(wav_bytes(speech.synthesize(text), speech.sample_rate)).decode()


@attrs.define
class _Streamed:
    """One streamed chat, read to its end."""

    first_text: float | None = None
    first_audio: float | None = None
    tokens: int | None = None  # the model's count (its usage)


async def _stream(
    http: Any, url: str, body: dict[str, Any], on_first: Callable[[], None] | None = None
) -> _Streamed:
    """POST a streamed chat and read it: when its first text and first audio came."""
    found = _Streamed()
    start = time.perf_counter()
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"a chat failed: {event['error']}")
            usage = event.get("usage")
            if usage:
                found.tokens = usage.get("completion_tokens")
            for choice in event.get("choices", ()):
                delta = choice.get("delta", {})
                if delta.get("content") and found.first_text is None:
                    found.first_text = time.perf_counter() - start
                    if on_first is not None:
                        on_first()
                if (delta.get("audio") or {}).get("data") and found.first_audio is None:
                    found.first_audio = time.perf_counter() - start
    return found


def _urgent_chat(question: str, priority: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "assistant",
        "modalities": ["text"],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "priority": priority,
        "messages": [{"role": "user", "content": question}],
    }


def _spoken_turn(wav: str, priority: int) -> dict[str, Any]:
    return {
        "model": "assistant",
        "modalities": ["text", "audio"],
        "audio": {"format": "pcm16"},
        "stream": True,
        "temperature": 0,
        "priority": priority,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}],
            }
        ],
    }


async def _queue_wait(http: Any, url: str, priority: int) -> tuple[float, int]:
    """From ``/metrics``: the seconds requests of ``priority`` waited for a slot at
    the stages that say (the thinker's ``queued_ms``), summed, and how many."""
    text = (await http.get(f"{url}/metrics")).text
    total, count = 0.0, 0
    for line in text.splitlines():
        if not line.startswith("omni_trio:queue_wait_seconds_") or "admission" in line:
            continue
        if f'priority="{priority}"' not in line:
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        if name.endswith("_sum"):
            total += value
        elif name.endswith("_count"):
            count += int(value)
    return total, count


@attrs.define
class _Load:
    """The load: ``chats`` clients, each streaming long chats back to back."""

    http: Any
    url: str
    sizes: Sizes
    priority: int
    generating: int = 0  # chats past their first token, not ended
    started: int = 0
    tokens: int = 0  # completion tokens of the chats that ended
    began: float = 0.0
    changed: trio.Event = attrs.Factory(trio.Event)

    async def client(self, index: int) -> None:
        from ._llm import story_prompts

        for count in itertools.count():
            prompt = story_prompts(1, index + count * self.sizes.chats)[0]
            body = {
                "model": "assistant",
                "modalities": ["text"],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": self.sizes.load_tokens,
                "temperature": 0,
                "priority": self.priority,
                "messages": [
                    {"role": "system", "content": LOAD_SYSTEM},
                    {"role": "user", "content": prompt},
                ],
            }
            self.started += 1
            seen = False

            def first() -> None:
                nonlocal seen
                seen = True
                self.generating += 1
                self.changed.set()

            try:
                done = await _stream(self.http, self.url, body, first)
            finally:
                if seen:
                    self.generating -= 1
            self.tokens += done.tokens or 0

    async def saturated(self, running: int) -> None:
        """Wait until ``running`` chats generate at once."""
        while self.generating < running:
            self.changed = trio.Event()
            await self.changed.wait()


async def _timed(
    rounds: int, ask: Callable[[int], Awaitable[_Streamed]], what: str, load: _Load | None
) -> tuple[list[float], list[int]]:
    """``rounds`` requests one after another: their times to ``what`` ("text" or
    "audio"), and the load's chats generating as each was sent."""
    times, generating = [], []
    for index in range(rounds):
        await trio.sleep(0.2)
        generating.append(load.generating if load is not None else 0)
        found = await ask(index)
        value = found.first_text if what == "text" else found.first_audio
        if value is None:
            raise RuntimeError(f"a request had no {what}")
        times.append(value)
    return times, generating


async def _server_part(sizes: Sizes, *, prioritised: bool, preempt: bool = False) -> dict[str, Any]:
    """One server: the urgent chat and the spoken turn, idle, then under the load
    (``preempt``: the prioritised server's thinker pauses the load for them)."""
    import httpx

    from ..config import shipped_pipeline

    def changes(config: Any) -> Any:
        if not prioritised:
            return _thinker(config, reserved_slots=0)
        return _thinker(config, preempt=True) if preempt else config

    (args,) = [s.engine_args for s in shipped_pipeline("assistant").stages if s.name == "thinker"]
    n_parallel = int(args["n_parallel"])
    reserved = int(args.get("reserved_slots", 0)) if prioritised else 0
    urgent = URGENT_PRIORITY if prioritised else 0
    load_priority = LOAD_PRIORITY if prioritised else 0
    rounds = sizes.rounds if prioritised else sizes.baseline_rounds
    # each its own question: llama.cpp would reuse a slot's cached prompt
    offset = 0 if prioritised else len(QUESTIONS) // 2
    questions = iter(QUESTIONS[offset:] + QUESTIONS[:offset])
    spoken = [_spoken_wav(text) for text in SPOKEN]
    spoken = spoken[offset // 2 :] + spoken[: offset // 2]
    said = iter(spoken)

    async with served("assistant", changes) as url, httpx.AsyncClient(timeout=600) as http:

        async def chat(_: int) -> _Streamed:
            return await _stream(
                http, url, _urgent_chat(next(questions), urgent, sizes.urgent_tokens)
            )

        async def turn(_: int) -> _Streamed:
            return await _stream(http, url, _spoken_turn(next(said), urgent))

        await chat(0)  # warm: the model's first prompt
        await turn(0)  # and Whisper's first call, the talker's first phrase
        idle_chat, _ = await _timed(rounds, chat, "text", None)
        idle_turn, _ = await _timed(rounds, turn, "audio", None)
        load = _Load(http, url, sizes, load_priority)
        async with trio.open_nursery() as nursery:
            load.began = time.perf_counter()
            for index in range(sizes.chats):
                nursery.start_soon(load.client, index)
            running = min(sizes.chats, n_parallel - reserved)
            with trio.fail_after(SATURATE_SECONDS):
                await load.saturated(running)
            before = await _queue_wait(http, url, urgent)
            busy_chat, chat_load = await _timed(rounds, chat, "text", load)
            busy_turn, turn_load = await _timed(rounds, turn, "audio", load)
            after = await _queue_wait(http, url, urgent)
            wall = time.perf_counter() - load.began
            nursery.cancel_scope.cancel()  # the chats hang up: aborted at the thinker
    return {
        "reserved_slots": reserved,
        "preempt": preempt,
        "n_parallel": n_parallel,
        "urgent_priority": urgent,
        "load_priority": load_priority,
        "chat": {
            "idle": summary(idle_chat),
            "busy": summary(busy_chat),
            "busy_over_idle": summary(busy_chat)["p50"] / summary(idle_chat)["p50"],
            "load_generating": chat_load,  # the load's chats generating as each was sent
        },
        "turn": {
            "idle": summary(idle_turn),
            "busy": summary(busy_turn),
            "busy_over_idle": summary(busy_turn)["p50"] / summary(idle_turn)["p50"],
            "load_generating": turn_load,
        },
        # the urgent requests' wait for a thinker slot under the load, as the thinker
        # says (on the baseline server, the load's chats have their priority too)
        "urgent_slot_wait": {
            "requests": after[1] - before[1],
            "mean": (after[0] - before[0]) / max(1, after[1] - before[1]),
        },
        "load": {
            "chats_started": load.started,
            "tokens_ended": load.tokens,  # of the chats that ended while it ran
            "seconds": wall,
        },
    }


async def chat_part(sizes: Sizes, *, preempt: bool = False) -> dict[str, Any]:
    """The prioritised server, then the baseline one."""
    load = os.getloadavg()[0]
    prioritised = await _server_part(sizes, prioritised=True, preempt=preempt)
    baseline = await _server_part(sizes, prioritised=False)
    return {
        "load_chats": sizes.chats,
        "load_tokens": sizes.load_tokens,
        "urgent_tokens": sizes.urgent_tokens,
        "prioritised": prioritised,
        "baseline": baseline,
        "load_average": [load, os.getloadavg()[0]],  # 1 minute, before and after
    }


# -- aging, on device-time engines -------------------------------------------------------------


def device_config(step_seconds: float, aging_s: float | None) -> Any:
    """``host`` then ``device`` (one slot, steps of ``step_seconds``), the device's
    slot aged by ``aging_s`` (``None``: strict priority)."""
    from ..config import parse_pipeline

    # the replica bench's pipeline, one worker: the slot's queue is the one measured
    toml = DEVICE_TOML.format(step_seconds=step_seconds, batch=1, replicas=1)
    config = parse_pipeline(toml, source="bench priority")
    host, device = config.stages
    device = msgspec.structs.replace(
        device, engine_args={**device.engine_args, "priority_aging_s": aging_s}
    )
    return msgspec.structs.replace(config, stages=[host, device])


async def _device_request(orch: Any, priority: int, started: float) -> dict[str, Any]:
    """A one-step request: when it was opened and answered (seconds from
    ``started``), and what the device said of it."""
    opened = time.perf_counter()
    found: dict[str, Any] | None = None
    async with orch.open_request({"steps": 1}, priority=priority) as stream:
        async for out in stream:
            if out.stage_id == 1 and out.data is not None and found is None:
                answered = time.perf_counter()
                found = dict(out.data)
    terminal = stream.terminal
    if found is None or terminal is None or terminal.finish_reason != "completed":
        why = "no terminal" if terminal is None else f"{terminal.finish_reason}: {terminal.error}"
        raise RuntimeError(f"a device request did not complete ({why})")
    return {
        "priority": priority,
        "opened": opened - started,
        "answered": answered - started,
        **{key: found[key] for key in ("waited", "held", "arrived", "order")},
    }


def bound_of(
    low: dict[str, Any], others: Sequence[dict[str, Any]], aging_s: float, step: float
) -> tuple[float, int]:
    """A low-priority request's bound on its wait for the device's slot, and how many
    requests may overtake it: those of a more urgent priority ``q`` that reach the
    device within ``(p - q) * aging_s`` of it. It waits at most for the requests the
    device held when it came (``held``, the one in its slot included: one step each),
    for those, and for a step's boundary::

        wait <= (held + overtakers + 1) * step

    (The simpler ``(p - q) * aging_s + held * step + step`` holds only while urgent
    work comes no faster than the device serves it.)"""
    p = low["priority"]
    overtakers = sum(
        1
        for other in others
        if other["priority"] < p
        and 0 < other["arrived"] - low["arrived"] < (p - other["priority"]) * aging_s
    )
    return (low["held"] + overtakers + 1) * step, overtakers


def naive_bound_of(low: dict[str, Any], aging_s: float, step: float) -> float:
    """The simpler bound, ``(p - p_high) * aging_s`` for the overtakers: right only
    while the urgent requests bring no more work than the device does in that time
    (:func:`bound_of` counts their work)."""
    return float((low["priority"] - P_HIGH) * aging_s + (low["held"] + 1) * step)


def _judge(requests: list[dict[str, Any]], aging_s: float | None, step: float) -> dict[str, Any]:
    """Each low-priority request's wait, its bound (with aging), and who overtook it
    (exact: from the device's own clock and the order it handed its slot in)."""
    lows = [r for r in requests if r["priority"] == P_LOW]
    late, farthest, ratios, naive = 0, 0.0, [], []
    longest: dict[str, Any] | None = None
    for low in lows:
        overtakers = [
            r for r in requests if r["arrived"] > low["arrived"] and r["order"] < low["order"]
        ]
        for other in overtakers:
            after = other["arrived"] - low["arrived"]
            farthest = max(farthest, after)
            window = (low["priority"] - other["priority"]) * AGING_S  # strict too: starved
            if other["priority"] >= low["priority"] or after >= window + CLOCK_SLACK:
                late += 1
        if aging_s is not None:
            bound, _ = bound_of(low, requests, aging_s, step)
            ratios.append(low["waited"] / bound)
            simple = naive_bound_of(low, aging_s, step)
            naive.append(low["waited"] / simple)
            if longest is None or low["waited"] > longest["waited"]:
                longest = {
                    **low,
                    "bound": bound,
                    "naive_bound": simple,
                    "overtakers": len(overtakers),
                }
    found: dict[str, Any] = {
        # overtakes by a request that came after the aged run's window (the strict
        # run's too: how far past it strict priority goes)
        "overtaken_late": late,
        "farthest_overtaker": farthest,  # seconds after the low one, the latest
    }
    if aging_s is not None and longest is not None:
        keys = ("waited", "held", "bound", "naive_bound", "overtakers", "opened")
        found["longest"] = {key: longest[key] for key in keys}
        found["wait_over_bound"] = max(ratios)
        found["wait_over_naive_bound"] = max(naive)
    return found


async def _aging_run(sizes: Sizes, aging_s: float | None) -> dict[str, Any]:
    """The urgent stream and the low-priority requests beside it, on one pipeline."""
    from .. import open_pipeline

    async with open_pipeline(device_config(sizes.step_seconds, aging_s)) as pipeline:
        orch = pipeline.orchestrator
        for priority in (P_HIGH, P_LOW, P_HIGH):  # warm-up
            await _device_request(orch, priority, 0.0)
        requests: list[dict[str, Any]] = []
        started = time.perf_counter()
        origin = trio.current_time()

        async def request(priority: int, at: float) -> None:
            await trio.sleep_until(origin + at)
            requests.append(await _device_request(orch, priority, started))

        highs = round(sizes.stream_seconds / sizes.high_interval)
        lows = round(sizes.stream_seconds / sizes.low_interval)
        async with trio.open_nursery() as nursery:
            for index in range(highs):
                nursery.start_soon(request, P_HIGH, index * sizes.high_interval)
            for index in range(lows):  # halfway between two urgent ones
                at = index * sizes.low_interval + sizes.high_interval / 2
                nursery.start_soon(request, P_LOW, at)
        wall = time.perf_counter() - started
    requests.sort(key=lambda r: r["order"])
    low = [r for r in requests if r["priority"] == P_LOW]
    high = [r for r in requests if r["priority"] == P_HIGH]
    in_stream = sum(r["answered"] <= sizes.stream_seconds for r in low)
    return {
        "aging_s": aging_s,
        "requests": {"high": len(high), "low": len(low)},
        "wall": wall,
        "low_completed_in_stream": in_stream,
        "low_rate": in_stream / sizes.stream_seconds,  # completed per second of the stream
        "high_rate": sum(r["answered"] <= sizes.stream_seconds for r in high)
        / sizes.stream_seconds,
        "low_wait": summary([r["waited"] for r in low]),  # at the device's slot
        "low_first_output": summary([r["answered"] - r["opened"] for r in low]),  # client
        "high_wait": summary([r["waited"] for r in high]),
        **_judge(requests, aging_s, sizes.step_seconds),
    }


async def aging_part(sizes: Sizes) -> dict[str, Any]:
    """The aged run, then the strict one."""
    load = os.getloadavg()[0]
    aged = await _aging_run(sizes, AGING_S)
    strict = await _aging_run(sizes, None)
    return {
        "step_seconds": sizes.step_seconds,
        "stream_seconds": sizes.stream_seconds,
        "high": {"priority": P_HIGH, "interval": sizes.high_interval},
        "low": {"priority": P_LOW, "interval": sizes.low_interval},
        # urgent work offered per second of device time: > 1 is an overload
        "offered_load": sizes.step_seconds / sizes.high_interval,
        "window": (P_LOW - P_HIGH) * AGING_S,
        "aged": aged,
        "strict": strict,
        "load_average": [load, os.getloadavg()[0]],  # 1 minute, before and after
    }


# -- the report --------------------------------------------------------------------------------


PARTS = ("chat", "aging")


async def run(quick: bool, parts: Sequence[str] = PARTS, preempt: bool = False) -> dict[str, Any]:
    sizes = Sizes.quick() if quick else Sizes.full()
    found: dict[str, Any] = {}
    if "chat" in parts:
        found["chat"] = await chat_part(sizes, preempt=preempt)
    if "aging" in parts:
        found["aging"] = await aging_part(sizes)
    return found


def run_priority_bench(*, quick: bool, console: Console) -> dict[str, Any] | None:
    """``{"results": ..., "goals": [...]}``, or ``None`` if the run failed (its error
    output is printed)."""
    argv = [sys.executable, "-m", "omni_trio.bench._priority"] + (["--quick"] if quick else [])
    results = run_part(argv, "benchmarking priority under saturation ...", console)
    if results is None:
        return None
    return {"results": results, "goals": goals(results)}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``{"key", "goal", "value", "limit", "met", "shown"}``."""
    aged = results["aging"]["aged"]
    values = {
        "priority.urgent_ttft_busy_over_idle": results["chat"]["prioritised"]["chat"][
            "busy_over_idle"
        ],
        "priority.aging_low_rate": aged["low_rate"],
        "priority.aging_overtaken_late": float(aged["overtaken_late"]),
        "priority.aging_wait_over_bound": aged["wait_over_bound"],
    }
    found = []
    for key, (goal, limit, at_most) in GOALS.items():
        value = values[key]
        if key.endswith("rate"):
            shown = f"{value:.1f}/s"
        elif key.endswith("late"):
            shown = f"{value:.0f}"
        else:
            shown = f"{value:.2f}x"
        found.append(
            {
                "key": key,
                "goal": goal,
                "value": value,
                "limit": limit,
                "met": value <= limit if at_most else value > limit,
                "shown": shown,
            }
        )
    return found


def print_priority_report(report: dict[str, Any], console: Console) -> None:
    """The figures, then how many goals are met."""
    priority = report["priority"]
    results = priority["results"]
    chat, aging = results["chat"], results["aging"]
    ours, base = chat["prioritised"], chat["baseline"]
    table = Table(
        title=f"The assistant beside {chat['load_chats']} long chats "
        f"({chat['load_tokens']} tokens; client side)"
    )
    for column in ("request", "priority", "idle p50 ms", "busy p50", "busy p90", "busy/idle"):
        table.add_column(column, justify="left" if column == "request" else "right")
    for kind, what in (("chat", "chat: first token"), ("turn", "turn: first audio")):
        for name, server in (("yes", ours), ("no", base)):
            figures = server[kind]
            table.add_row(
                what,
                name,
                ms(figures["idle"]["p50"]),
                ms(figures["busy"]["p50"]),
                ms(figures["busy"]["p90"]),
                f"{figures['busy_over_idle']:.2f}x",
            )
    console.print(table)
    console.print(
        f"With priority: the urgent requests {ours['urgent_priority']}, the chats "
        f"{ours['load_priority']}, {ours['reserved_slots']} of the thinker's "
        f"{ours['n_parallel']} slots reserved; without: every request "
        f"{base['urgent_priority']}, {base['reserved_slots']} reserved. Under the load, "
        f"an urgent request waited for a thinker slot {ms(ours['urgent_slot_wait']['mean'])} "
        f"ms on average with priority."
    )
    table = Table(
        title=f"Aging on a device of one slot ({ms(aging['step_seconds'])} ms steps): urgent "
        f"requests every {ms(aging['high']['interval'])} ms ({aging['offered_load']:.2f}x "
        f"its capacity), low-priority every {ms(aging['low']['interval'])} ms, for "
        f"{aging['stream_seconds']:.1f} s"
    )
    for column in ("aging", "low done/s", "low wait p50 ms", "max ms", "bound ms", "late"):
        table.add_column(column, justify="left" if column == "aging" else "right")
    for run_ in (aging["aged"], aging["strict"]):
        longest = run_.get("longest")
        table.add_row(
            "none (strict)" if run_["aging_s"] is None else f"{run_['aging_s']} s",
            f"{run_['low_rate']:.1f}",
            ms(run_["low_wait"]["p50"]),
            ms(run_["low_wait"]["max"]),
            "" if longest is None else ms(longest["bound"]),
            str(run_["overtaken_late"]),
        )
    console.print(table)
    console.print(
        f"late: low-priority requests overtaken by one that reached the device after "
        f"its window ({aging['window']:.2f} s with aging); strict, the latest overtaker "
        f"came {aging['strict']['farthest_overtaker']:.2f} s after."
    )
    longest = aging["aged"]["longest"]
    console.print(
        f"Aged, the longest wait: {ms(longest['waited'])} ms, {longest['held']} requests "
        f"ahead as it came and {longest['overtakers']} overtakers; bound "
        f"{ms(longest['bound'])} ms (the work ahead, the urgent work arriving within "
        f"the window, a step). With the window's length in place of that work, "
        f"{ms(longest['naive_bound'])} ms: the waits reach "
        f"{aging['aged']['wait_over_naive_bound']:.2f}x it, as the urgent requests "
        f"bring {aging['offered_load']:.2f} s of device time per second."
    )
    met = sum(row["met"] for row in priority["goals"])
    console.print(f"Priority goals met: {met} of {len(priority['goals'])}")
    for goal in priority["goals"]:
        console.print(f"  {show_met(goal['met'])} {goal['goal']}: {goal['shown']}")


def priority_missing() -> str | None:
    """What the priority scenarios need and is not installed (``None``: nothing):
    the served assistant's (the serve extra, httpx, the llm extra and its model,
    the voice extra)."""
    from ._llm_report import llm_missing

    missing = [name for name in ("hypercorn", "starlette", "httpx") if not importable(name)]
    said = []
    if missing:
        said.append(
            f"{', '.join(missing)}, which is not installed: pip install 'omni-trio[serve]' httpx"
        )
    model = llm_missing()
    if model is not None:
        said.append(model.removeprefix("the language model's scenarios need "))
    return "the priority scenarios need " + "; ".join(said) if said else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench._priority")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=PARTS, help="only this part")
    parser.add_argument(
        "--preempt",
        action="store_true",
        help="the prioritised server's thinker also preempts (llama_cpp(preempt=True))",
    )
    args = parser.parse_args(argv)
    parts = PARTS if args.part is None else (args.part,)
    print(json.dumps(trio.run(run, args.quick, parts, args.preempt)))


if __name__ == "__main__":
    main()
