"""The language model's scenarios: ``omni_trio.llm:llama_cpp`` (SmolLM2-135M on
llama.cpp) weighed against llama.cpp alone, and in the ``assistant`` pipeline.

``python -m omni_trio.bench._llm --part NAME [--quick]`` runs one part in a process
of its own and prints its results as JSON; :mod:`omni_trio.bench._llm_report` runs
them all, judges the goals and prints the tables. Every model runs on one thread
(``threads = 1``, as the assistant's does: on 2 cores the other is the
orchestrator's, the client's and the worker's loop), temperature 0.

- ``throughput``: the orchestrator's cost and continuous batching. The same
  requests (story prompts, up to ``max_tokens`` each), :data:`CONCURRENCY` at a
  time, three ways: ``direct``, an ``xllamacpp.Server`` in this process, loaded as
  the engine loads it (:func:`omni_trio.llm._llama.load_server`: the same model,
  ``n_parallel``, ``threads`` and ``n_ctx``) and called from plain threads with the
  body the engine sends (:func:`~omni_trio.llm._llama.request_body`); ``pipeline``,
  a one-stage pipeline of the engine in a worker process, through the orchestrator
  (:func:`omni_trio.open_pipeline`, one ``open_request`` per request); and
  ``one_slot``, that pipeline with ``n_parallel = 1``. Tokens/s is the completion
  tokens (the model's own count, its ``usage``) over the wall time of the lot.
  Each round runs the three back to back, their order rotating; a ratio is the
  median over the rounds of the round's.
- ``cancel``: what a cancelled request costs the next. A one-stage pipeline with
  one slot (``n_parallel = 1``: the next request needs the slot the cancelled one
  held). Trials in pairs. *Idle*: a story's first :data:`ABORT_AFTER` tokens, run
  to their end, a pause, then a question: its first token's time from its
  ``open_request``. *After a cancel*: the same story, aborted (its block left) once
  :data:`ABORT_AFTER` tokens came, and the question submitted at once. Meanwhile
  llama.cpp's own view of its slot is polled (``GET /slots`` on its HTTP listener,
  on loopback; the worker's only TCP listener, found through ``/proc``): the slot
  is free once it is not processing the story's task any more.
- ``heartbeat``: a long story (``heartbeat_tokens``) on the worker while this
  process pings it (:meth:`~omni_trio.process.ProcessStage.refresh_statistics`,
  a ``Ping`` answered by the worker's Trio loop) every :data:`PING_INTERVAL`: the
  longest gap between two answers while the model generates, and the longest
  round trip.
- ``turns``: the ``assistant`` pipeline (Whisper tiny.en, SmolLM2-135M, eSpeak NG)
  served on ``/v1/realtime``, one session, speculation on, a handful of spoken
  turns: :func:`omni_trio.bench._voice.turns_part` times them from its client
  process, and from the server's side (each response's request, its outputs
  stamped as the session took them). The model's share of a turn's wait: how much
  of the time from ``speech_stopped`` to the first audio the model spent between
  the transcript and the talker's first phrase.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import threading
import time
import urllib.request
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from .. import open_pipeline
from .._conversation import check_sampling
from ..config import PipelineConfig, PipelineSection, StageConfig
from ..llm._chat import chat_of
from ..llm._llama import load_server, request_body
from ._voice import Sizes as VoiceSizes
from ._voice import summary, turns_part

__all__ = [
    "ABORT_AFTER",
    "CONCURRENCY",
    "N_PARALLEL",
    "PING_INTERVAL",
    "QUESTION",
    "THREADS",
    "Sizes",
    "cancel_part",
    "heartbeat_part",
    "llama_address",
    "main",
    "model_config",
    "model_share",
    "story_prompts",
    "throughput_part",
    "turns_of_assistant",
]

#: The model's threads, everywhere (the assistant's: on 2 cores, one is the rest's).
THREADS = 1
#: Tokens of context per slot (the assistant's).
N_CTX = 2048
#: The slots of ``direct`` and ``pipeline``, and the requests at a time in
#: ``throughput`` (the assistant's ``n_parallel``).
N_PARALLEL = 4
CONCURRENCY = 4
#: ``throughput``: the tokens of each warm-up request.
WARM_TOKENS = 4
#: ``cancel``: a story is aborted once this many of its tokens came.
ABORT_AFTER = 8
#: ``cancel``: the story's length, were it not aborted.
STORY_TOKENS = 200
#: ``cancel``: the question whose first token is timed, and its length.
QUESTION = "What is the opposite of hot?"
QUESTION_TOKENS = 8
#: ``cancel``: how long an idle worker idles before the question.
IDLE_PAUSE = 0.2
#: ``cancel``: llama.cpp's slots polled every this many seconds after an abort.
POLL_INTERVAL = 0.001
#: ``heartbeat``: a ping every this many seconds (after the last one's answer).
PING_INTERVAL = 0.01
#: The story prompts: every animal with every deed.
ANIMALS = ("dragon", "cat", "robot", "sailor", "fox", "whale", "baker", "owl", "knight", "ant")
DEEDS = (
    "learns to fly",
    "loses a key",
    "finds a map",
    "builds a boat",
    "meets a ghost",
    "wins a race",
    "plants a tree",
    "climbs a mountain",
)


@attrs.frozen
class Sizes:
    """How much each part does.

    Attributes:
      rounds: ``throughput``'s rounds (each: direct, pipeline, one slot).
      requests: Requests per round and way.
      max_tokens: Tokens per request, at most (the stories go on longer).
      trials: ``cancel``'s pairs of trials (idle, after a cancel).
      heartbeat_tokens: The length of ``heartbeat``'s story.
      turns: ``turns``' spoken turns.
    """

    rounds: int
    requests: int
    max_tokens: int
    trials: int
    heartbeat_tokens: int
    turns: int

    @classmethod
    def full(cls) -> Sizes:
        return cls(rounds=5, requests=8, max_tokens=64, trials=10, heartbeat_tokens=200, turns=6)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(rounds=1, requests=4, max_tokens=8, trials=2, heartbeat_tokens=40, turns=1)


def story_prompts(count: int, start: int = 0) -> list[str]:
    """``count`` story prompts, from the ``start``-th on (each a different one, for
    up to ``len(ANIMALS) * len(DEEDS)``: llama.cpp reuses a slot's cached prompt)."""
    every = [f"Write a long story about a {a} who {d}." for d in DEEDS for a in ANIMALS]
    return [every[(start + index) % len(every)] for index in range(count)]


def _sampling(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 0.95}


def model_config(n_parallel: int, max_tokens: int) -> PipelineConfig:
    """A one-stage pipeline: the language model in a worker process, its text the
    user's (forward mode: no connector)."""
    stage = StageConfig(
        stage_id=0,
        name="thinker",
        engine="omni_trio.llm:llama_cpp",
        engine_args={
            "n_parallel": n_parallel,
            "n_ctx": N_CTX,
            "threads": THREADS,
            **_sampling(max_tokens),
        },
        final_output=True,
        final_output_type="text",
    )
    section = PipelineSection(name="llm", async_chunk=False, connector="none")
    return PipelineConfig(stages=[stage], pipeline=section)


def _stage_args(config: PipelineConfig) -> dict[str, Any]:
    return dict(config.stages[0].engine_args)


# -- throughput --------------------------------------------------------------------------------


def _direct(server: Any, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """``bodies`` through ``server``, ``concurrency`` threads each calling it in turn
    (blocking): the completion tokens and the wall time."""
    pending = iter(bodies)
    lock = threading.Lock()
    tokens: list[int] = []

    def call() -> None:
        while True:
            with lock:
                body = next(pending, None)
            if body is None:
                return
            usage: list[int] = []

            def chunk(data: dict[str, Any], usage: list[int] = usage) -> bool:
                if data.get("usage"):
                    usage.append(int(data["usage"]["completion_tokens"]))
                return False

            server.handle_chat_completions(body, chunk)
            with lock:
                tokens.extend(usage)

    threads = [threading.Thread(target=call) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return _rate(tokens, wall)


def _rate(tokens: list[int], wall: float) -> dict[str, Any]:
    return {
        "requests": len(tokens),
        "tokens": sum(tokens),
        "seconds": wall,
        "tokens_per_second": sum(tokens) / wall,
    }


async def _through(orchestrator: Any, prompts: Sequence[Any], concurrency: int) -> dict[str, Any]:
    """``prompts`` through the orchestrator, ``concurrency`` at a time, each read to
    its terminal: the completion tokens (its ``meta``'s usage) and the wall time."""
    pending = iter(prompts)
    tokens: list[int] = []

    async def client() -> None:
        for prompt in pending:
            async with orchestrator.open_request(prompt) as stream:
                async for _ in stream:
                    pass
            terminal = stream.terminal
            if terminal is None or terminal.finish_reason != "completed":
                raise RuntimeError(f"a request did not complete: {terminal}")
            tokens.append(int(terminal.meta["usage"]["completion_tokens"]))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    return _rate(tokens, time.perf_counter() - started)


async def throughput_part(sizes: Sizes) -> dict[str, Any]:
    """Rounds of the same requests directly, through the orchestrator, and through it
    with one slot."""
    batched = model_config(N_PARALLEL, sizes.max_tokens)
    one_slot = model_config(1, sizes.max_tokens)
    args = _stage_args(batched)
    server = await trio.to_thread.run_sync(partial(load_server, None, N_PARALLEL, N_CTX, THREADS))
    defaults = check_sampling(_sampling(sizes.max_tokens))

    def bodies(prompts: list[str]) -> list[dict[str, Any]]:
        return [request_body(chat_of(p), p, defaults, None) for p in prompts]

    load = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "pipeline": [], "one_slot": []}
    async with open_pipeline(batched) as pipeline, open_pipeline(one_slot) as single:
        # every model once, before the clock: llama.cpp's first batch is slower
        warm = story_prompts(CONCURRENCY, len(ANIMALS) * len(DEEDS) - CONCURRENCY)
        short = check_sampling(_sampling(WARM_TOKENS))
        warm_bodies = [request_body(chat_of(p), p, short, None) for p in warm]
        await trio.to_thread.run_sync(_direct, server, warm_bodies, CONCURRENCY)
        said = [{"text": p, "sampling": {"max_tokens": WARM_TOKENS}} for p in warm]
        await _through(pipeline.orchestrator, said, CONCURRENCY)
        await _through(single.orchestrator, said, CONCURRENCY)
        for index in range(sizes.rounds):
            prompts = story_prompts(sizes.requests, index * sizes.requests)
            ways = {
                "direct": partial(
                    trio.to_thread.run_sync, _direct, server, bodies(prompts), CONCURRENCY
                ),
                "pipeline": partial(_through, pipeline.orchestrator, prompts, CONCURRENCY),
                "one_slot": partial(_through, single.orchestrator, prompts, CONCURRENCY),
            }
            order = list(ways)
            order = order[index % 3 :] + order[: index % 3]
            for way in order:
                runs[way].append({**await ways[way](), "round": index})
    return {
        "model": "SmolLM2-135M-Instruct (Q4_1)",
        "engine_args": args,
        "concurrency": CONCURRENCY,
        "rounds": sizes.rounds,
        "requests": sizes.requests,
        "runs": runs,
        "orchestrator_ratio": _median_ratio(runs["pipeline"], runs["direct"]),
        "batching_ratio": _median_ratio(runs["pipeline"], runs["one_slot"]),
        "load_average": [load, os.getloadavg()[0]],
    }


def _median_ratio(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> float:
    """The median over the rounds of the round's tokens/s ratio."""
    ratios = [
        a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(ours, theirs, strict=True)
    ]
    return float(statistics.median(ratios))


# -- cancel ------------------------------------------------------------------------------------


def llama_address(pid: int) -> str:
    """The URL of llama.cpp's HTTP listener in process ``pid``: its TCP listener on
    127.0.0.1 (a local worker's chunk links listen on a Unix socket), checked by
    asking it for ``/slots``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        found = re.fullmatch(r"socket:\[(\d+)\]", target)
        if found:
            inodes.add(found[1])
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state != "0A" or inode not in inodes:  # 0A: LISTEN
            continue
        host, port = local.split(":")
        if host != "0100007F":  # 127.0.0.1
            continue
        url = f"http://127.0.0.1:{int(port, 16)}"
        try:
            _slots(url)
        except (OSError, ValueError, TypeError):
            continue
        return url
    raise RuntimeError(f"no llama.cpp listener found in process {pid}")


def _slots(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/slots", timeout=5) as answer:
        slots: list[dict[str, Any]] = json.load(answer)
    if not isinstance(slots, list):
        raise TypeError("not llama.cpp's /slots")
    return slots


def _busy(url: str) -> dict[int, int]:
    """Each processing slot's task id."""
    return {s["id"]: s["id_task"] for s in _slots(url) if s.get("is_processing")}


def _wait_free(url: str, task: int | None, deadline: float) -> tuple[float | None, int]:
    """Poll llama.cpp's slots until none processes ``task`` (``None``: none
    processes anything): when the answer that said so came, and how many polls."""
    polls = 0
    while time.perf_counter() < deadline:
        polls += 1
        busy = _busy(url)
        if (task is None and not busy) or (task is not None and task not in busy.values()):
            return time.perf_counter(), polls
        time.sleep(POLL_INTERVAL)
    return None, polls


async def _first_token(orchestrator: Any, prompt: Any) -> dict[str, Any]:
    """``prompt`` read to its end: its first text's time from its ``open_request``."""
    started = time.perf_counter()
    first = None
    async with orchestrator.open_request(prompt) as stream:
        async for out in stream:
            if first is None and out.data:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"the question got no text: {stream.terminal}")
    return {"started": started, "ttft": first - started}


async def _story(orchestrator: Any, max_tokens: int, *, abort: bool, url: str) -> dict[str, Any]:
    """A story: to its end (its ``max_tokens`` being :data:`ABORT_AFTER`), or, with
    ``abort``, aborted once that many tokens came: then the slot's task it held, and
    when it was aborted (its block left)."""
    prompt = {"text": story_prompts(1)[0], "sampling": {"max_tokens": max_tokens}}
    outputs = 0
    found: dict[str, Any] = {}
    async with orchestrator.open_request(prompt) as stream:
        async for out in stream:
            if out.data:
                outputs += 1
            if abort and outputs >= ABORT_AFTER:
                (found["task"],) = (await trio.to_thread.run_sync(_busy, url)).values()
                found["aborted"] = time.perf_counter()
                break
    return {**found, "outputs": outputs}


async def _until_free(url: str, task: int | None) -> tuple[float | None, int]:
    deadline = time.perf_counter() + 5.0
    return await trio.to_thread.run_sync(_wait_free, url, task, deadline)


async def _idle_trial(orchestrator: Any, url: str, question: Any) -> dict[str, Any]:
    """The story's first tokens to their end, a pause, then the question."""
    await _story(orchestrator, ABORT_AFTER, abort=False, url=url)
    await _until_free(url, None)
    await trio.sleep(IDLE_PAUSE)
    timed = await _first_token(orchestrator, question)
    await _until_free(url, None)
    return timed


async def _after_cancel(orchestrator: Any, url: str, question: Any) -> dict[str, Any]:
    """The story aborted once its first tokens came, and the question at once; the
    slot watched meanwhile."""
    story = await _story(orchestrator, STORY_TOKENS, abort=True, url=url)
    aborted = story["aborted"]
    freed: list[tuple[float | None, int]] = []

    async def watch() -> None:
        freed.append(await _until_free(url, story["task"]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        timed = await _first_token(orchestrator, question)
    free_at, polls = freed[0]
    await _until_free(url, None)
    return {
        **timed,
        "story_outputs": story["outputs"],
        "submitted": timed["started"] - aborted,
        "slot_free": None if free_at is None else free_at - aborted,
        "polls": polls,
    }


async def cancel_part(sizes: Sizes) -> dict[str, Any]:
    """Pairs of trials: a question on an idle worker, and right after a cancel."""
    config = model_config(1, sizes.max_tokens)
    question = {"text": QUESTION, "sampling": {"max_tokens": QUESTION_TOKENS}}
    load = os.getloadavg()[0]
    idle: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []
    async with open_pipeline(config) as pipeline:
        orchestrator = pipeline.orchestrator
        pid = pipeline.stages[0].statistics().pid
        assert pid is not None
        url = await trio.to_thread.run_sync(llama_address, pid)
        await _first_token(orchestrator, question)  # warm
        for _ in range(sizes.trials):
            idle.append(await _idle_trial(orchestrator, url, question))
            after.append(await _after_cancel(orchestrator, url, question))
    idle_ttft = [t["ttft"] for t in idle]
    after_ttft = [t["ttft"] for t in after]
    free = [t["slot_free"] for t in after if t["slot_free"] is not None]
    return {
        "engine_args": _stage_args(config),
        "trials": sizes.trials,
        "abort_after": ABORT_AFTER,
        "question_tokens": QUESTION_TOKENS,
        "idle_pause": IDLE_PAUSE,
        "idle_ttft": summary(idle_ttft),
        "after_ttft": summary(after_ttft),
        "ttft_difference": statistics.median(after_ttft) - statistics.median(idle_ttft),
        "slot_free": summary(free) if free else None,
        "slot_missed": sum(t["slot_free"] is None for t in after),
        "submitted": summary([t["submitted"] for t in after]),
        "each": {"idle": idle, "after_cancel": after},
        "load_average": [load, os.getloadavg()[0]],
    }


# -- heartbeat ---------------------------------------------------------------------------------


async def heartbeat_part(sizes: Sizes) -> dict[str, Any]:
    """A long story on the worker, pinged every :data:`PING_INTERVAL` meanwhile."""
    config = model_config(1, sizes.heartbeat_tokens)
    prompt = {"text": story_prompts(1)[0], "sampling": {"max_tokens": sizes.heartbeat_tokens}}
    load = os.getloadavg()[0]
    async with open_pipeline(config) as pipeline:
        stage = pipeline.stages[0]
        orchestrator = pipeline.orchestrator
        await _first_token(orchestrator, QUESTION)  # warm
        pings: list[tuple[float, float]] = []  # (sent, answered)

        async def ping() -> None:
            while True:
                sent = time.perf_counter()
                await stage.refresh_statistics()
                pings.append((sent, time.perf_counter()))
                await trio.sleep(PING_INTERVAL)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping)
            await trio.sleep(0.1)
            first = None
            async with orchestrator.open_request(prompt) as stream:
                async for out in stream:
                    if first is None and out.data:
                        first = time.perf_counter()
            last = time.perf_counter()
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    terminal = stream.terminal
    if first is None or terminal is None or terminal.meta is None:
        raise RuntimeError(f"the story did not come: {terminal}")
    answers = [answered for _, answered in pings]
    # the gaps that end while the model generates: its first token to its last
    gaps = [b - a for a, b in itertools.pairwise(answers) if first < b <= last]
    trips = [answered - sent for sent, answered in pings if first <= sent <= last]
    return {
        "engine_args": _stage_args(config),
        "tokens": int(terminal.meta["usage"]["completion_tokens"]),
        "generation_seconds": last - first,
        "ping_interval": PING_INTERVAL,
        "pings": len(trips),
        "longest_gap": max(gaps),
        "gap": summary(gaps),
        "round_trip": summary(trips),
        "heartbeat_interval": stage.options.heartbeat_interval,
        "load_average": [load, os.getloadavg()[0]],
    }


# -- turns -------------------------------------------------------------------------------------


def model_share(server: dict[str, float | None]) -> float | None:
    """Of a turn's wait, from ``speech_stopped`` to the first audio (the server's),
    the seconds the model spent between the transcript and the talker's first
    phrase (``None``: the trace missed a moment)."""
    transcript, phrase, audio = (
        server.get(k) for k in ("transcript", "first_phrase", "first_audio")
    )
    if transcript is None or phrase is None or audio is None:
        return None
    return max(0.0, min(phrase, audio) - max(transcript, 0.0))


async def turns_of_assistant(sizes: Sizes) -> dict[str, Any]:
    """:func:`omni_trio.bench._voice.turns_part` on ``assistant``: one session,
    speculation on, ``sizes.turns`` turns; with the model's share of each."""
    voice = VoiceSizes(sessions=(1,), turns=(sizes.turns,), trials=0, pause=0.5, spread=0.0)
    found = await turns_part(voice, "assistant", speculation=(True,))
    run = found["runs"]["speculate"]["1"]
    shares = []
    for turn in run["each"]:
        turn["model_wait"] = model_share(turn["server"])
        audio = turn["server"].get("first_audio")
        if turn["model_wait"] is not None and audio:
            shares.append(turn["model_wait"] / audio if audio > 0 else 0.0)
    waits = [t["model_wait"] for t in run["each"] if t["model_wait"] is not None]
    if waits:
        run["model_wait"] = summary(waits)
        run["model_share"] = summary(shares)
    return found


PARTS = {
    "throughput": throughput_part,
    "cancel": cancel_part,
    "heartbeat": heartbeat_part,
    "turns": turns_of_assistant,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench._llm")
    parser.add_argument("--part", choices=list(PARTS), required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes.full()
    print(json.dumps(trio.run(PARTS[args.part], sizes)))


if __name__ == "__main__":
    main()
