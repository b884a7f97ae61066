"""``omni-trio bench --only audio``: OpenAI's audio endpoints, served, measured from a
client's side of the socket.

``python -m omni_trio.bench._audio [--quick]`` prints one JSON object. It serves a
shipped pipeline on 127.0.0.1 in this process (Hypercorn and the orchestrator on this
Trio loop, the stages in worker processes) and asks it with ``httpx``:

- **speech, idle**: ``/v1/audio/speech`` on the ``speech`` pipeline (eSpeak NG's
  talker and code2wav), a 200-character input, streamed ``pcm``, one request at a
  time: the time to the first byte of audio, and the real-time factor (the request's
  time over the audio's length);
- **speech at concurrency 8**: eight such requests at once, their first bytes;
- **speech beside chats**: the same request while the pipeline's thinker answers 4
  chats (the ``assistant`` pipeline's language model where the ``llm`` extra and its
  model are installed, else the ``speech`` pipeline's simulated thinker): a speech
  request's route passes the thinker by, so its first byte should hardly move;
- **transcription**: ``/v1/audio/transcriptions`` of 10 s of eSpeak NG's speech on
  the ``voice`` pipeline (Whisper tiny.en), one at a time (where the voice extra is
  installed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

from ._parts import importable, ms, run_part
from ._process_report import show_met
from ._served import served, summary

__all__ = [
    "GOALS",
    "audio_missing",
    "goals",
    "main",
    "print_audio_report",
    "run",
    "run_audio_bench",
]

#: A 200-character input (what the goals are measured on).
TEXT = (
    "The river ran quietly past the old mill, and the children watched the boats "
    "drift by in the golden light of the late afternoon, counting the ducks that "
    "followed them home along the muddy bank for tea."
)
assert len(TEXT) == 200, len(TEXT)
#: Ten seconds of eSpeak NG's speech, for the transcription.
SPOKEN = (
    "Please tell me about the weather in London today, and whether I should take an "
    "umbrella when I walk to the station this evening after work, because the last "
    "time I forgot it I was soaked right through to the skin."
)
#: key -> (what, limit): the issue's goals.
GOALS = {
    "audio.speech_first_byte_p50": ("speech, concurrency 1: first byte p50 <= 150 ms", 0.150),
    "audio.speech_rtf": ("speech, concurrency 1: real-time factor <= 0.1", 0.1),
    "audio.speech_c8_over_c1": ("speech, concurrency 8: first byte p50 <= 2x concurrency 1", 2.0),
    "audio.speech_busy_over_idle": (
        "speech beside 4 chats: first byte p50 <= 1.5x idle",
        1.5,
    ),
}


async def _speak(http: Any, url: str, model: str) -> tuple[float, float, int]:
    """One streamed speech request: (seconds to its first byte, to its end, bytes)."""
    body = {"model": model, "input": TEXT, "voice": "alloy", "response_format": "pcm"}
    start = time.perf_counter()
    first = None
    size = 0
    async with http.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
        response.raise_for_status()
        async for piece in response.aiter_raw():
            if first is None and piece:
                first = time.perf_counter() - start
            size += len(piece)
    assert first is not None, "no audio"
    return first, time.perf_counter() - start, size


async def _at_once(count: int, call: Callable[[], Any]) -> list[Any]:
    found: list[Any] = []

    async def one() -> None:
        found.append(await call())

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return found


async def _speech(quick: bool) -> dict[str, Any]:
    import httpx

    rounds = 3 if quick else 10
    async with served("speech") as url, httpx.AsyncClient(timeout=120) as http:
        call = partial(_speak, http, url, "espeak-omni")
        await call()  # warm: each worker's first phrase
        idle = [await call() for _ in range(rounds)]
        c8: list[tuple[float, float, int]] = []
        for _ in range(1 if quick else 3):
            c8 += await _at_once(8, call)
    audio_seconds = [size / 2 / 24_000 for _, _, size in idle]
    return {
        "input_chars": len(TEXT),
        "idle": {
            "first_byte": summary([f for f, _, _ in idle]),
            "total": summary([t for _, t, _ in idle]),
            "audio_seconds": statistics.median(audio_seconds),
            "rtf": statistics.median(
                t / a for (_, t, _), a in zip(idle, audio_seconds, strict=True)
            ),
        },
        "c8": {"first_byte": summary([f for f, _, _ in c8])},
    }


async def _busy(quick: bool) -> dict[str, Any]:
    """Speech alone, then beside 4 chats, on one deployment."""
    import httpx

    from ..bench._llm_report import llm_missing
    from ..bench._voice_report import voice_missing

    real = llm_missing() is None and voice_missing() is None
    name, model = ("assistant", "assistant") if real else ("speech", "espeak-omni")
    rounds = 3 if quick else 8
    async with served(name) as url, httpx.AsyncClient(timeout=300) as http:
        call = partial(_speak, http, url, model)
        await call()
        idle = [(await call())[0] for _ in range(rounds)]
        chat = {
            "model": model,
            "modalities": ["text"],
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "Tell me a long story about a river."}],
        }
        busy: list[float] = []

        async def chats() -> None:
            while True:
                await http.post(f"{url}/v1/chat/completions", json=chat)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(chats)
            await trio.sleep(0.5)  # the chats are under way
            busy = [(await call())[0] for _ in range(rounds)]
            nursery.cancel_scope.cancel()  # the chats hang up: aborted at the thinker
    return {
        "pipeline": name,
        "thinker": "language model" if real else "simulated",
        "idle": summary(idle),
        "busy": summary(busy),
    }


async def _transcription(quick: bool) -> dict[str, Any] | None:
    import httpx

    from .._audio import wav_bytes
    from ..bench._voice_report import voice_missing
    from ..speech import ESpeak

    if voice_missing() is not None:
        return None
    speech = ESpeak.get()
    pcm = speech.synthesize(SPOKEN)
    wav = wav_bytes(pcm, speech.sample_rate)
    rounds = 2 if quick else 6
    times = []
    async with served("voice") as url, httpx.AsyncClient(timeout=120) as http:
        for _ in range(rounds + 1):
            start = time.perf_counter()
            files = {"file": ("q.wav", wav)}
            response = await http.post(
                f"{url}/v1/audio/transcriptions", data={"model": "voice-omni"}, files=files
            )
            response.raise_for_status()
            times.append(time.perf_counter() - start)
    return {
        "audio_seconds": len(pcm) / 2 / speech.sample_rate,
        "text": response.json()["text"],
        "seconds": summary(times[1:]),  # the first warms Whisper
    }


async def run(quick: bool) -> dict[str, Any]:
    return {
        "speech": await _speech(quick),
        "busy": await _busy(quick),
        "transcription": await _transcription(quick),
    }


def run_audio_bench(*, quick: bool, console: Console) -> dict[str, Any] | None:
    """``{"results": ..., "goals": [...]}``, or ``None`` if the run failed (its error
    output is printed)."""
    argv = [sys.executable, "-m", "omni_trio.bench._audio"] + (["--quick"] if quick else [])
    results = run_part(argv, "benchmarking the audio endpoints ...", console)
    if results is None:
        return None
    return {"results": results, "goals": goals(results)}


def print_audio_report(report: dict[str, Any], console: Console) -> None:
    """The figures, then how many goals are met."""
    audio = report["audio"]
    results = audio["results"]
    speech, busy, heard = results["speech"], results["busy"], results["transcription"]
    table = Table(title="/v1/audio/speech and /v1/audio/transcriptions (client side)")
    for column in ("what", "p50 ms", "p90 ms", "n"):
        table.add_column(column, justify="left" if column == "what" else "right")

    def row(what: str, figures: dict[str, float]) -> None:
        table.add_row(what, ms(figures["p50"]), ms(figures["p90"]), str(figures["n"]))

    chars = speech["input_chars"]
    row(f"speech, {chars} chars, pcm: first byte, alone", speech["idle"]["first_byte"])
    row("  the whole request, alone", speech["idle"]["total"])
    row("  first byte, 8 at once", speech["c8"]["first_byte"])
    row(f"  first byte, {busy['pipeline']}, idle", busy["idle"])
    row(f"  first byte, beside 4 chats ({busy['thinker']} thinker)", busy["busy"])
    if heard is not None:
        row(f"transcription of {heard['audio_seconds']:.1f} s of speech", heard["seconds"])
    console.print(table)
    console.print(
        f"speech: {speech['idle']['audio_seconds']:.1f} s of audio, RTF "
        f"{speech['idle']['rtf']:.3f}"
        + ("" if heard is not None else "; transcription skipped (no voice extra)")
    )
    met = sum(row["met"] for row in audio["goals"])
    console.print(f"Audio goals met: {met} of {len(audio['goals'])}")
    for goal in audio["goals"]:
        console.print(f"  {show_met(goal['met'])} {goal['goal']}: {goal['shown']}")


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``{"key", "goal", "value", "limit", "met", "shown"}``."""
    speech, busy = results["speech"], results["busy"]
    c1 = speech["idle"]["first_byte"]["p50"]
    values = {
        "audio.speech_first_byte_p50": c1,
        "audio.speech_rtf": speech["idle"]["rtf"],
        "audio.speech_c8_over_c1": speech["c8"]["first_byte"]["p50"] / c1,
        "audio.speech_busy_over_idle": busy["busy"]["p50"] / busy["idle"]["p50"],
    }
    found = []
    for key, (goal, limit) in GOALS.items():
        value = values[key]
        shown = f"{value * 1e3:.0f} ms" if key.endswith("p50") else f"{value:.2f}"
        found.append(
            {
                "key": key,
                "goal": goal,
                "value": value,
                "limit": limit,
                "met": value <= limit,
                "shown": shown,
            }
        )
    return found


def audio_missing() -> str | None:
    """What the audio scenarios need and is not installed (``None``: nothing)."""
    from ..speech import speech_available

    missing = [name for name in ("hypercorn", "starlette", "av", "httpx") if not importable(name)]
    if not speech_available():
        missing.append("eSpeak NG (espeakng-loader)")
    if not missing:
        return None
    return (
        f"the audio scenarios need {', '.join(missing)}, which is not installed: "
        "pip install 'omni-trio[serve,speech]' httpx"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench._audio")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(json.dumps(trio.run(run, args.quick)))


if __name__ == "__main__":
    main()
