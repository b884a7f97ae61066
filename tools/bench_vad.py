"""The realtime server's voice activity detector, measured: which model to use, and
what it costs.

The audio is eSpeak NG speech with known pauses: turns of one to three sentences,
the sentences of a turn 250 ms apart (a pause inside a turn: longer than the default
``speculate_after_ms``, shorter than ``silence_duration_ms``), the turns 1000 ms apart
(a turn's end). Each sentence is trimmed to its first and last audible sample, so the
truth -- where each turn starts and ends -- is known to the sample. It is resampled to
the Realtime API's 24 kHz with :class:`omni_trio.speech.Resampler`, then heard clean
and in seeded white noise at a few signal-to-noise ratios (the speech's RMS over the
noise's); and, for false starts, a minute each of no speech: digital silence, the
white noise alone, bursts of loud noise 5 to 80 ms long (knocks), and fragments of
the speech 10 to 60 ms long (lip smacks, a word's edge from a television), one a
second or so.

For each model (Silero VAD v6, and WebRTC's VAD at each aggressiveness):

- cost: µs of CPU per 20 ms of audio, fed in 20 ms chunks as a client sends it (the
  median of several passes over the clean audio; resampling included), and the
  model's own µs per frame;
- turn ends found against the true ones (missed, extra: a turn split at a pause or a
  turn found in noise), with the default options (``VadOptions()``);
- timing: the speech start and the turn end against the truth, in ms (negative:
  early), and when each event came (the audio fed by then, in 20 ms chunks);
- the pauses inside turns that got a speculation (``SilenceStarted`` then
  ``SpeechResumed``);
- false starts per minute without speech, and when a start comes, for
  ``min_speech_ms`` of 0 to 96 (:data:`omni_trio.speech.MIN_SPEECH_MS` is the
  default).

The accuracy runs compute each model's probabilities once per audio and replay them
through the detector (for each ``min_speech_ms``); only the cost runs feed audio in
20 ms chunks. The resampler is measured too: cost per 20 ms chunk, and a sine's
frequency and amplitude kept, for the PyAV (libswresample) one the package uses and
a windowed-sinc polyphase filter written with numpy (the alternative).

Run (one core's worth of work; about a minute)::

    PYTHONPATH=src python tools/bench_vad.py [--save docs/results/vad-python3.11.json]
    PYTHONPATH=src python tools/bench_vad.py --from docs/results/vad-python3.11.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from omni_trio.speech import (
    ESpeak,
    FrameModel,
    Resampler,
    SilenceStarted,
    SileroModel,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
    VadEvent,
    VadOptions,
    VoiceActivityDetector,
    WebRtcModel,
    default_model,
)

RATE = 24_000  # the Realtime API's
CHUNK_MS = 20
SEED = 20_240_601

SENTENCES = [
    "Could you tell me what the weather will be like tomorrow morning?",
    "I would like to book a table for two at eight o'clock.",
    "The train to the airport leaves every fifteen minutes.",
    "Please remind me to call my sister after lunch.",
    "What is the capital of Australia?",
    "Turn the lights off in the living room.",
    "My flight was delayed, so I will be late for the meeting.",
    "How many cups of flour go into a loaf of bread?",
    "Read me the last message from Alex.",
    "Set a timer for twenty minutes, and then play some music.",
    "Yes.",
    "Thank you very much.",
    "Actually, never mind, let me think about it.",
    "The library opens at nine and closes at six on weekdays.",
    "Translate good morning into French.",
    "Which of these two phones has the better camera?",
]
VOICES = [("en", 175), ("en-us", 160), ("en-gb-x-rp", 190), ("en-029", 170)]
TURNS = 16
PAUSE_MS = 250  # between the sentences of a turn
GAP_MS = 1000  # between turns
LEAD_MS = 600  # silence before the first turn
TAIL_MS = 1200  # after the last
SNRS_DB = (20, 10, 5)
NOISE_ONLY_S = 60
MIN_SPEECH = (0, 32, 64, 96)
BURSTS_MS = (5, 20, 40, 80)
BLIPS_MS = (10, 20, 40, 60)
AUDIBLE = 100  # |sample| above this (-50 dBFS) is a sentence's sound, for the truth


def _models() -> dict[str, Callable[[], FrameModel]]:
    models: dict[str, Callable[[], FrameModel]] = {"silero": SileroModel}
    for level in (3, 2, 1, 0):
        models[f"webrtc-{level}"] = lambda level=level: WebRtcModel(level, frame_ms=30)
    models["webrtc-3/20ms"] = lambda: WebRtcModel(3, frame_ms=20)
    return models


# -- the audio ------------------------------------------------------------------------------


def _sentence(text: str, voice: str, wpm: int) -> np.ndarray:
    espeak = ESpeak.get()
    resampler = Resampler(espeak.sample_rate, RATE)
    pcm = resampler.feed(espeak.synthesize(text, voice=voice, words_per_minute=wpm))
    samples = np.frombuffer(pcm + resampler.flush(), "<i2")
    audible = np.flatnonzero(np.abs(samples.astype(np.int32)) > AUDIBLE)
    return samples[audible[0] : audible[-1] + 1]


def build_speech(seed: int = SEED) -> tuple[np.ndarray, dict[str, Any]]:
    """The speech audio (int16 at 24 kHz) and its truth: each turn's start and end,
    and each pause inside a turn, in ms."""
    rng = np.random.default_rng(seed)
    parts = [np.zeros(RATE * LEAD_MS // 1000, np.int16)]
    at = len(parts[0])
    turns, pauses = [], []
    order = rng.permutation(len(SENTENCES)).tolist()
    for turn in range(TURNS):
        voice, wpm = VOICES[turn % len(VOICES)]
        count = int(rng.integers(1, 4))
        start = at
        for index in range(count):
            if index:
                pause = np.zeros(RATE * PAUSE_MS // 1000, np.int16)
                pauses.append((at * 1000 / RATE, (at + len(pause)) * 1000 / RATE))
                parts.append(pause)
                at += len(pause)
            if not order:
                order = rng.permutation(len(SENTENCES)).tolist()
            speech = _sentence(SENTENCES[order.pop()], voice, wpm)
            parts.append(speech)
            at += len(speech)
        turns.append((start * 1000 / RATE, at * 1000 / RATE))
        gap = np.zeros(RATE * (GAP_MS if turn < TURNS - 1 else TAIL_MS) // 1000, np.int16)
        parts.append(gap)
        at += len(gap)
    audio = np.concatenate(parts)
    spoken = np.concatenate(
        [audio[int(s * RATE / 1000) : int(e * RATE / 1000)] for s, e in turns]
    ).astype(np.float64)
    truth = {
        "turns": turns,
        "pauses": pauses,
        "seconds": len(audio) / RATE,
        "speech_rms": float(np.sqrt(np.mean(spoken**2))),
    }
    return audio, truth


def noise(samples: int, rms: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, rms, samples)


def with_noise(audio: np.ndarray, rms: float, seed: int) -> np.ndarray:
    mixed = audio.astype(np.float64) + noise(len(audio), rms, seed)
    return np.clip(np.rint(mixed), -32768, 32767).astype(np.int16)


def bursts(seconds: float, rms: float, seed: int) -> np.ndarray:
    """Short bursts of white noise as loud as the speech (``BURSTS_MS`` long, one
    every second or so) over quiet noise (40 dB below): clicks and knocks, which
    ``min_speech_ms`` is there to ignore."""
    rng = np.random.default_rng(seed)
    audio = rng.normal(0.0, rms / 100, int(RATE * seconds))
    at = 0.5
    while at < seconds - 0.2:
        length = int(RATE * int(rng.choice(BURSTS_MS)) / 1000)
        start = int(at * RATE)
        audio[start : start + length] += rng.normal(0.0, rms, length)
        at += float(rng.uniform(0.8, 1.4))
    return np.clip(np.rint(audio), -32768, 32767).astype(np.int16)


def blips(seconds: float, speech: np.ndarray, truth: dict[str, Any], seed: int) -> np.ndarray:
    """Fragments of the speech, ``BLIPS_MS`` long (shorter than a syllable; faded in
    and out over 2 ms), one every second or so, over quiet noise: a lip smack, a word's
    edge from a television -- speech-like sound that is no one speaking to us."""
    rng = np.random.default_rng(seed)
    audio = rng.normal(0.0, truth["speech_rms"] / 100, int(RATE * seconds))
    fade = RATE * 2 // 1000
    at = 0.5
    while at < seconds - 0.2:
        length = int(RATE * int(rng.choice(BLIPS_MS)) / 1000)
        begin, end = truth["turns"][int(rng.integers(len(truth["turns"])))]
        source = int(rng.uniform(begin, end - 100) * RATE / 1000)
        piece = speech[source : source + length].astype(np.float64)
        ramp = np.minimum(1.0, np.minimum(np.arange(length) + 1, length - np.arange(length)) / fade)
        start = int(at * RATE)
        audio[start : start + length] += piece * ramp
        at += float(rng.uniform(0.8, 1.4))
    return np.clip(np.rint(audio), -32768, 32767).astype(np.int16)


# -- running the detector ----------------------------------------------------------------


class Replay:
    """A :class:`~omni_trio.speech.FrameModel` that replays probabilities computed once."""

    def __init__(self, frame_samples: int, probabilities: list[float]) -> None:
        self.frame_samples = frame_samples
        self._probabilities = iter(probabilities)

    def probability(self, frame: bytes) -> float:
        return next(self._probabilities)

    def reset(self) -> None:
        pass


class Recording:
    """Wraps a model: records each frame's probability."""

    def __init__(self, model: FrameModel) -> None:
        self.model = model
        self.frame_samples = model.frame_samples
        self.probabilities: list[float] = []

    def probability(self, frame: bytes) -> float:
        p = self.model.probability(frame)
        self.probabilities.append(p)
        return p

    def reset(self) -> None:
        self.model.reset()


def probabilities(make: Callable[[], FrameModel], audio: np.ndarray) -> tuple[int, list[float]]:
    recording = Recording(make())
    VoiceActivityDetector(model=recording, min_speech_ms=0).feed(audio.tobytes())
    return recording.frame_samples, recording.probabilities


def events(
    frame_samples: int, probs: list[float], audio: np.ndarray, min_speech_ms: int
) -> list[tuple[int, VadEvent]]:
    """The events, each with the ms of audio fed when it came (in 20 ms chunks)."""
    detector = VoiceActivityDetector(
        model=Replay(frame_samples, probs), min_speech_ms=min_speech_ms
    )
    pcm = audio.tobytes()
    step = RATE * CHUNK_MS // 1000 * 2
    found = []
    for i in range(0, len(pcm), step):
        found += [(detector.audio_ms, e) for e in detector.feed(pcm[i : i + step])]
    return found


@contextmanager
def _quiet_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def cost(make: Callable[[], FrameModel], audio: np.ndarray, passes: int) -> dict[str, float]:
    """µs per 20 ms chunk fed (resampling included), the median of ``passes`` passes;
    and the model's µs per frame (median over every frame of the last pass)."""
    step = RATE * CHUNK_MS // 1000 * 2
    pcm = audio.tobytes()
    chunks = [pcm[i : i + step] for i in range(0, len(pcm), step)]
    per_chunk = []
    frame_times: list[float] = []
    for _ in range(passes):
        detector = VoiceActivityDetector(model=make())
        with _quiet_gc():
            started = time.perf_counter_ns()
            for chunk in chunks:
                detector.feed(chunk)
            per_chunk.append((time.perf_counter_ns() - started) / len(chunks) / 1e3)
    model = make()
    frame = model.frame_samples * 2
    resampled = Resampler(RATE, 16_000).feed(pcm)
    with _quiet_gc():
        for i in range(0, len(resampled) - frame + 1, frame):
            piece = resampled[i : i + frame]
            started = time.perf_counter_ns()
            model.probability(piece)
            frame_times.append((time.perf_counter_ns() - started) / 1e3)
    return {
        "us_per_20ms": statistics.median(per_chunk),
        "us_per_20ms_passes": per_chunk,
        "frame_ms": model.frame_samples / 16,
        "model_us_per_frame": statistics.median(frame_times),
    }


# -- scoring -----------------------------------------------------------------------------


def _summary(errors: list[float]) -> dict[str, float | None]:
    if not errors:
        return {"median": None, "mean_abs": None, "worst": None}
    return {
        "median": statistics.median(errors),
        "mean_abs": statistics.fmean(abs(e) for e in errors),
        "worst": max(errors, key=abs),
    }


def score(timed: list[tuple[int, VadEvent]], truth: dict[str, Any]) -> dict[str, Any]:
    """The events against the truth.

    A turn's start is the first :class:`SpeechStarted` from 200 ms before it to its
    end; its end, the first :class:`SpeechStopped` from 200 ms before its end to the
    next turn's start. Every other start or stop is extra. A pause inside a turn is
    speculated when a :class:`SilenceStarted` falls in it and a :class:`SpeechResumed`
    follows it before the turn ends. The delays are from the true start (end) to the
    ms of audio fed when the event came.
    """
    turns = truth["turns"]
    found = [e for _, e in timed]
    starts = [(t, e.audio_start_ms) for t, e in timed if isinstance(e, SpeechStarted)]
    stops = [(t, e.audio_end_ms) for t, e in timed if isinstance(e, SpeechStopped)]
    start_errors, stop_errors, start_delays, stop_delays = [], [], [], []
    for index, (start, end) in enumerate(turns):
        following = turns[index + 1][0] if index + 1 < len(turns) else math.inf
        hit = next(((t, s) for t, s in starts if start - 200 <= s <= end), None)
        if hit is not None:
            start_errors.append(hit[1] - start)
            start_delays.append(hit[0] - start)
        hit = next(((t, s) for t, s in stops if end - 200 <= s < following), None)
        if hit is not None:
            stop_errors.append(hit[1] - end)
            stop_delays.append(hit[0] - end)
    speculated = 0
    for begin, finish in truth["pauses"]:
        turn_end = next(e for s, e in turns if s <= begin <= e)
        silence = [
            e for e in found if isinstance(e, SilenceStarted) and begin - 100 <= e.audio_ms < finish
        ]
        resumed = [
            e for e in found if isinstance(e, SpeechResumed) and begin <= e.audio_ms <= turn_end
        ]
        speculated += bool(silence and resumed)
    return {
        "turns": len(turns),
        "ends_found": len(stop_errors),
        "ends_missed": len(turns) - len(stop_errors),
        "ends_extra": len(stops) - len(stop_errors),
        "starts_extra": len(starts) - len(start_errors),
        "start_error_ms": _summary(start_errors),
        "stop_error_ms": _summary(stop_errors),
        "start_delay_ms": _summary(start_delays),
        "stop_delay_ms": _summary(stop_delays),
        "pauses": len(truth["pauses"]),
        "pauses_speculated": speculated,
        "speculations": sum(isinstance(e, SilenceStarted) for e in found),
    }


# -- the resampler -----------------------------------------------------------------------


class NumpyResampler:
    """The alternative measured: a Kaiser-windowed sinc, polyphase, in numpy (16 zero
    crossings a side at the lower rate, cutoff at 0.9 of its Nyquist). Causal: the
    output is late by its half-length (about 1 ms)."""

    def __init__(self, in_rate: int, out_rate: int, zeros: int = 16, rolloff: float = 0.9):
        g = math.gcd(in_rate, out_rate)
        self.up, self.down = out_rate // g, in_rate // g
        ratio = min(1.0, self.up / self.down)
        self.half = math.ceil(zeros / ratio)
        self.taps = 2 * self.half
        phases = np.arange(self.up)[:, None] / self.up
        tau = phases + self.half - 1 - np.arange(self.taps)[None, :]
        window = np.i0(8.0 * np.sqrt(np.clip(1 - (tau / self.half) ** 2, 0, None))) / np.i0(8.0)
        cutoff = ratio * rolloff
        self.bank = cutoff * np.sinc(cutoff * tau) * window
        self.history = np.zeros(self.taps - 1)
        self.base = -(self.taps - 1)  # the input index of history[0]
        self.taken = self.given = 0

    def feed(self, pcm: bytes) -> bytes:
        self.history = np.concatenate([self.history, np.frombuffer(pcm, "<i2")])
        self.taken += len(pcm) // 2
        end = -(-self.taken * self.up // self.down)
        n = np.arange(self.given, end, dtype=np.int64) * self.down
        first = n // self.up - self.taps + 1 - self.base
        window = self.history[first[:, None] + np.arange(self.taps)[None, :]]
        out = np.einsum("ij,ij->i", window, self.bank[n % self.up])
        self.given = end
        drop = max(
            0, min(end * self.down // self.up - self.taps + 1 - self.base, len(self.history))
        )
        self.history, self.base = self.history[drop:], self.base + drop
        return np.clip(np.rint(out), -32768, 32767).astype("<i2").tobytes()

    def flush(self) -> bytes:
        return self.feed(bytes(2 * (self.half + 1)))  # pushes the last input out


def _tone(frequency: float, rate: int, seconds: float) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return np.rint(16_000 * np.sin(2 * np.pi * frequency * t)).astype("<i2").tobytes()


def _peak(pcm: bytes, rate: int) -> tuple[float, float]:
    """The strongest frequency (Hz, interpolated) of the middle second, and its amplitude
    as a fraction of 16,000."""
    samples = np.frombuffer(pcm, "<i2").astype(np.float64)
    middle = samples[len(samples) // 2 - rate // 2 : len(samples) // 2 + rate // 2]
    window = np.hanning(len(middle))
    spectrum = np.abs(np.fft.rfft(middle * window))
    k = int(np.argmax(spectrum[1:-1])) + 1
    a, b, c = np.log(spectrum[k - 1 : k + 2] + 1e-12)
    shift = 0.5 * (a - c) / (a - 2 * b + c)
    amplitude = spectrum[k] / (window.sum() / 2) / 16_000
    return (k + shift) * rate / len(middle), float(amplitude)


def resampler_report(calls: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    makers: dict[str, Callable[[int, int], Any]] = {
        "pyav": Resampler,
        "numpy-polyphase": NumpyResampler,
    }
    for in_rate, out_rate in ((24_000, 16_000), (22_050, 24_000)):
        for name, make in makers.items():
            chunk = _tone(440, in_rate, CHUNK_MS / 1000)
            resampler = make(in_rate, out_rate)
            times = []
            with _quiet_gc():
                for _ in range(calls):
                    started = time.perf_counter_ns()
                    resampler.feed(chunk)
                    times.append((time.perf_counter_ns() - started) / 1e3)
            tones = {}
            for frequency in (440, 1000, 3000, 6000, 9000):
                resampler = make(in_rate, out_rate)
                tone = _tone(frequency, in_rate, 3.0)
                step = in_rate * CHUNK_MS // 1000 * 2
                pcm = b"".join(
                    resampler.feed(tone[i : i + step]) for i in range(0, len(tone), step)
                )
                pcm += resampler.flush()
                heard, amplitude = _peak(pcm, out_rate)
                tones[str(frequency)] = {"heard_hz": heard, "amplitude": amplitude}
            found[f"{in_rate}->{out_rate} {name}"] = {
                "us_per_20ms": statistics.median(times),
                "tones": tones,
            }
    return found


# -- the sitting -------------------------------------------------------------------------


def measure(console: Console, passes: int) -> dict[str, Any]:
    with console.status("eSpeak NG speaks the turns ..."):
        speech, truth = build_speech()
    rms = truth["speech_rms"]
    console.print(
        f"{truth['seconds']:.1f} s of audio: {len(truth['turns'])} turns, "
        f"{len(truth['pauses'])} pauses inside them; speech RMS {rms:.0f}"
    )
    conditions: dict[str, np.ndarray] = {"clean": speech}
    quiet: dict[str, np.ndarray] = {"silence": np.zeros(RATE * NOISE_ONLY_S, np.int16)}
    for index, snr in enumerate(SNRS_DB):
        level = rms / 10 ** (snr / 20)
        conditions[f"snr {snr} dB"] = with_noise(speech, level, SEED + index)
        quiet[f"noise at snr {snr} dB"] = with_noise(quiet["silence"], level, SEED + 100 + index)
    quiet["noise bursts"] = bursts(NOISE_ONLY_S, rms, SEED + 200)
    quiet["speech blips"] = blips(NOISE_ONLY_S, speech, truth, SEED + 300)
    report: dict[str, Any] = {
        "audio": {
            **{k: truth[k] for k in ("seconds", "speech_rms")},
            "turns": len(truth["turns"]),
            "pauses": len(truth["pauses"]),
            "pause_ms": PAUSE_MS,
            "gap_ms": GAP_MS,
            "snr_db": list(SNRS_DB),
            "noise_only_s": NOISE_ONLY_S,
            "truth": truth,
        },
        "options": {
            k: getattr(VadOptions(), k)
            for k in ("threshold", "prefix_padding_ms", "silence_duration_ms", "speculate_after_ms")
        },
        "models": {},
    }
    default_min = VoiceActivityDetector.__init__.__kwdefaults__["min_speech_ms"]
    report["min_speech_ms"] = default_min
    for name, make in _models().items():
        with console.status(f"{name}: accuracy ..."):
            accuracy: dict[str, Any] = {}
            false_starts: dict[str, dict[str, float]] = {}
            for condition, audio in conditions.items():
                frame, probs = probabilities(make, audio)
                accuracy[condition] = {
                    str(m): score(events(frame, probs, audio, m), truth) for m in MIN_SPEECH
                }
            for condition, audio in quiet.items():
                frame, probs = probabilities(make, audio)
                minutes = len(audio) / RATE / 60
                false_starts[condition] = {
                    str(m): sum(
                        isinstance(e, SpeechStarted) for _, e in events(frame, probs, audio, m)
                    )
                    / minutes
                    for m in MIN_SPEECH
                }
        with console.status(f"{name}: cost ..."):
            spent = cost(make, speech, passes)
        report["models"][name] = {
            "cost": spent,
            "accuracy": accuracy,
            "false_starts_per_minute": false_starts,
        }
    with console.status("the resamplers ..."):
        report["resampler"] = resampler_report(calls=3000)
    report["default_model"] = type(default_model()).__name__
    return report


# -- printing ----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:+.0f}"


def show(report: dict[str, Any], console: Console) -> None:
    console.print(f"$ {report['command']}")
    console.print(
        f"Python {report['python']} on {report['machine']}; onnxruntime "
        f"{report['versions']['onnxruntime']}, webrtcvad-wheels "
        f"{report['versions']['webrtcvad-wheels']}, av {report['versions']['av']}"
    )
    audio = report["audio"]
    options = report["options"]
    m = str(report["min_speech_ms"])
    console.print(
        f"{audio['seconds']:.1f} s of speech audio: {audio['turns']} turns "
        f"({audio['gap_ms']} ms apart), {audio['pauses']} pauses of {audio['pause_ms']} ms "
        f"inside them; options {options}; min_speech_ms {m}"
    )
    table = Table(title="cost per 20 ms of 24 kHz audio, fed in 20 ms chunks")
    for column in ("model", "µs / 20 ms", "% of a core", "frame ms", "model µs / frame"):
        table.add_column(column, justify="right")
    for name, model in report["models"].items():
        spent = model["cost"]
        table.add_row(
            name,
            f"{spent['us_per_20ms']:.1f}",
            f"{spent['us_per_20ms'] / 20e3:.2%}",
            f"{spent['frame_ms']:g}",
            f"{spent['model_us_per_frame']:.1f}",
        )
    console.print(table)
    table = Table(
        title=f"turns (min_speech_ms {m}); timing in ms, median / worst: the event's time "
        "against the truth (err), and when it came (after)"
    )
    for column in (
        "model", "audio", "ends found", "missed", "extra", "extra starts",
        "start err", "start after", "end err", "end after", "pauses hinted", "hints",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for name, model in report["models"].items():
        for condition, by_min in model["accuracy"].items():
            s = by_min[m]
            table.add_row(
                name,
                condition,
                f"{s['ends_found']}/{s['turns']}",
                str(s["ends_missed"]),
                str(s["ends_extra"]),
                str(s["starts_extra"]),
                *(
                    f"{_ms(s[key]['median'])} / {_ms(s[key]['worst'])}"
                    for key in (
                        "start_error_ms",
                        "start_delay_ms",
                        "stop_error_ms",
                        "stop_delay_ms",
                    )
                ),
                f"{s['pauses_speculated']}/{s['pauses']}",
                str(s["speculations"]),
            )
        table.add_section()
    console.print(table)
    mins = list(next(iter(report["models"].values()))["accuracy"]["clean"])
    table = Table(
        title="by min_speech_ms: false starts per minute without speech; in the speech "
        "audio (all of it, clean and noisy), extra starts and when a start came (median ms)"
    )
    table.add_column("model")
    table.add_column("audio")
    for value in mins:
        table.add_column(f"{value} ms", justify="right")
    for name, model in report["models"].items():
        for quiet, by_min in model["false_starts_per_minute"].items():
            table.add_row(name, f"{quiet}: starts / min", *(f"{by_min[v]:.1f}" for v in mins))
        speech = model["accuracy"].values()
        table.add_row(
            name,
            "speech: extra starts",
            *(str(sum(a[v]["starts_extra"] for a in speech)) for v in mins),
        )
        delays = [
            statistics.median(
                a[v]["start_delay_ms"]["median"]
                for a in speech
                if a[v]["start_delay_ms"]["median"] is not None
            )
            for v in mins
        ]
        table.add_row(name, "speech: start came after", *(_ms(d) for d in delays))
        table.add_section()
    console.print(table)
    table = Table(
        title="the resamplers, fed 20 ms chunks: a tone's frequency (Hz) and amplitude "
        "(9 kHz is above 16 kHz's band: at 16 kHz, what is left of it)"
    )
    table.add_column("resampler")
    table.add_column("µs / 20 ms", justify="right")
    tones = next(iter(report["resampler"].values()))["tones"]
    for tone in tones:
        table.add_column(f"{tone} Hz", justify="right")
    for name, found in report["resampler"].items():
        table.add_row(
            name,
            f"{found['us_per_20ms']:.1f}",
            *(f"{t['heard_hz']:.2f} at {t['amplitude']:.3f}" for t in found["tones"].values()),
        )
    console.print(table)
    console.print(f"default model: {report['default_model']}")


def _rounded(value: Any) -> Any:
    """Floats to 3 decimals (µs and ms to the ns and µs: more is noise)."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tools/bench_vad.py")
    parser.add_argument("--passes", type=int, default=7, help="cost passes per model")
    parser.add_argument("--save", type=Path, help="also write the report here (JSON)")
    parser.add_argument("--from", dest="saved", type=Path, help="re-print a saved report")
    args = parser.parse_args()
    console = Console(width=160)
    if args.saved is not None:
        show(json.loads(args.saved.read_text()), console)
        return
    report: dict[str, Any] = {
        "command": "python tools/bench_vad.py " + " ".join(sys.argv[1:]),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {
            name: version(name) for name in ("onnxruntime", "webrtcvad-wheels", "av", "numpy")
        },
    }
    report |= measure(console, args.passes)
    if args.save is not None:
        args.save.write_text(json.dumps(_rounded(report), indent=1) + "\n")
    show(report, console)


if __name__ == "__main__":
    main()
