"""The realtime server's voice activity detector and its resampler: the options'
checks, resampling that does not care how the audio is cut, the detector's rules on
scripted probabilities, and Silero and WebRTC on eSpeak NG speech with known pauses
(``tools/bench_vad.py`` measures the same at length)."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import random

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_trio.speech import (
    MIN_SPEECH_MS,
    ESpeak,
    Resampler,
    SilenceStarted,
    SileroModel,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
    VadOptions,
    VoiceActivityDetector,
    WebRtcModel,
    default_model,
    speech_available,
)

#: ``OMNI_TRIO_REQUIRE_VOICE=1``: a missing voice extra fails these tests, not skips them.
if os.environ.get("OMNI_TRIO_REQUIRE_VOICE") == "1":
    import av  # noqa: F401
    import numpy as np
    import onnxruntime  # noqa: F401
    import webrtcvad  # noqa: F401

    assert importlib.util.find_spec("faster_whisper"), "SileroModel needs faster-whisper"
    assert speech_available(), "the tests speak with eSpeak NG (espeakng-loader)"
else:
    np = pytest.importorskip("numpy")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("webrtcvad")
    pytest.importorskip("av")
    if importlib.util.find_spec("faster_whisper") is None or not speech_available():
        pytest.skip(
            "the voice extra (faster-whisper) or eSpeak NG is missing", allow_module_level=True
        )

RATE = 24_000
MS = RATE // 1000 * 2  # bytes per ms at 24 kHz


# -- options --------------------------------------------------------------------------------


def test_the_defaults_are_openais():
    options = VadOptions()
    assert (options.threshold, options.prefix_padding_ms, options.silence_duration_ms) == (
        0.5,
        300,
        500,
    )
    assert options.speculate_after_ms == 150
    assert options.exit_threshold == pytest.approx(0.35)
    assert VadOptions(threshold=0.1).exit_threshold == 0.01


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("threshold", -0.1),
        ("threshold", 1.5),
        ("threshold", math.nan),
        ("threshold", True),
        ("threshold", "0.5"),
        ("prefix_padding_ms", -1),
        ("prefix_padding_ms", 1.5),
        ("silence_duration_ms", 0),
        ("silence_duration_ms", None),
        ("speculate_after_ms", -5),
        ("speculate_after_ms", 500),  # not less than silence_duration_ms
        ("speculate_after_ms", 900),
    ],
)
def test_options_refuse_what_is_out_of_range_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        VadOptions(**{field: value})


def test_options_take_edges_and_no_hint():
    VadOptions(threshold=0, prefix_padding_ms=0, silence_duration_ms=1, speculate_after_ms=0)
    VadOptions(threshold=1, silence_duration_ms=200, speculate_after_ms=199)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        VadOptions().threshold = 0.7  # type: ignore[misc]


def test_the_detector_checks_its_own_arguments():
    with pytest.raises(ValueError, match="sample_rate"):
        VoiceActivityDetector(sample_rate=0, model=Scripted([]))
    with pytest.raises(ValueError, match="min_speech_ms"):
        VoiceActivityDetector(min_speech_ms=-1, model=Scripted([]))
    with pytest.raises(ValueError, match="aggressiveness"):
        WebRtcModel(4)
    with pytest.raises(ValueError, match="frame_ms"):
        WebRtcModel(frame_ms=10)


# -- the resampler ------------------------------------------------------------------------------


def tone(frequency: float, rate: int, seconds: float, amplitude: float = 16_000) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return np.rint(amplitude * np.sin(2 * np.pi * frequency * t)).astype("<i2").tobytes()


def peak(pcm: bytes, rate: int) -> tuple[float, float]:
    """The strongest frequency of the middle second (Hz, interpolated) and its amplitude."""
    samples = np.frombuffer(pcm, "<i2").astype(np.float64)
    middle = samples[len(samples) // 2 - rate // 2 : len(samples) // 2 + rate // 2]
    window = np.hanning(len(middle))
    spectrum = np.abs(np.fft.rfft(middle * window))
    k = int(np.argmax(spectrum[1:-1])) + 1
    a, b, c = np.log(spectrum[k - 1 : k + 2])
    return (k + 0.5 * (a - c) / (a - 2 * b + c)) * rate / len(middle), spectrum[k] / (
        window.sum() / 2
    )


def in_chunks(resampler: Resampler, pcm: bytes, sizes: list[int]) -> bytes:
    out, at, index = [], 0, 0
    while at < len(pcm):
        size = sizes[index % len(sizes)]
        out.append(resampler.feed(pcm[at : at + size]))
        at += size
        index += 1
    return b"".join(out) + resampler.flush()


RATES = [(24_000, 16_000), (22_050, 24_000), (16_000, 24_000), (48_000, 16_000)]


@pytest.mark.parametrize(("in_rate", "out_rate"), RATES)
def test_a_resampled_tone_keeps_its_frequency_and_amplitude(in_rate, out_rate):
    for frequency in (440, 1000, 3000):
        pcm = Resampler(in_rate, out_rate)
        out = in_chunks(pcm, tone(frequency, in_rate, 2.0), [in_rate // 50 * 2])  # 20 ms
        heard, amplitude = peak(out, out_rate)
        assert heard == pytest.approx(frequency, abs=0.5)
        assert amplitude == pytest.approx(16_000, rel=0.01)


@pytest.mark.parametrize(("in_rate", "out_rate"), RATES)
def test_chunks_of_any_size_resample_as_the_whole(in_rate, out_rate):
    rng = random.Random(in_rate + out_rate)
    pcm = np.random.default_rng(7).integers(-20_000, 20_000, in_rate // 2, "<i2").tobytes()
    whole = in_chunks(Resampler(in_rate, out_rate), pcm, [len(pcm)])
    for _ in range(3):
        sizes = [rng.randint(1, 3001) for _ in range(50)]  # odd sizes split samples
        assert in_chunks(Resampler(in_rate, out_rate), pcm, sizes) == whole


@pytest.mark.parametrize(("in_rate", "out_rate"), RATES)
def test_resampled_lengths_do_not_drift(in_rate, out_rate):
    resampler = Resampler(in_rate, out_rate)
    rng = random.Random(3)
    taken = given_out = 0
    lags = set()
    for _ in range(400):
        samples = rng.randint(1, 2000)
        given_out += len(resampler.feed(bytes(2 * samples))) // 2
        taken += samples
        lags.add(round(taken * out_rate / in_rate - given_out))
    # held back: the filter's lookahead, the same few samples all along
    assert max(lags) - min(lags) <= 1
    assert 0 <= min(lags) <= 32
    given_out += len(resampler.flush()) // 2
    assert 0 <= given_out - taken * out_rate // in_rate <= 1


@pytest.mark.parametrize("samples", [0, 1, 2, 5, 17, 40, 441])
def test_a_short_stream_still_has_its_length(samples):
    resampler = Resampler(22_050, 24_000)
    out = resampler.feed(bytes(2 * samples)) + resampler.flush()
    assert 0 <= len(out) // 2 - samples * 24_000 // 22_050 <= 1


def test_flush_ends_a_stream_and_the_next_starts_fresh():
    pcm = tone(440, RATE, 0.3)
    resampler = Resampler(RATE, 16_000)
    first = resampler.feed(pcm) + resampler.flush()
    second = resampler.feed(pcm) + resampler.flush()
    assert first == second


def test_an_odd_byte_waits_for_the_next_feed_and_one_rate_passes_through():
    pcm = tone(440, RATE, 0.1)
    same = Resampler(RATE, RATE)
    assert same.feed(pcm[:101]) + same.feed(pcm[101:]) == pcm
    assert same.feed(b"\x01") == b""
    assert same.flush() == b""  # the half sample is dropped
    assert same.feed(pcm[:4]) == pcm[:4]
    down, whole = Resampler(RATE, 16_000), Resampler(RATE, 16_000)
    split = down.feed(pcm[:101]) + down.feed(pcm[101:]) + down.flush()
    assert split == whole.feed(pcm) + whole.flush()


@pytest.mark.parametrize("bad", [0, -16_000, 16_000.0, True])
def test_resampler_rates_are_positive_integers(bad):
    with pytest.raises(ValueError, match="in_rate"):
        Resampler(bad, 16_000)
    with pytest.raises(ValueError, match="out_rate"):
        Resampler(16_000, bad)


# -- the rules, on scripted probabilities ---------------------------------------------------


class Scripted:
    """A model that says what it is told: one probability per 20 ms frame (then 0)."""

    frame_samples = 320

    def __init__(self, probabilities: list[float]) -> None:
        self.probabilities = list(probabilities)
        self.frames = 0
        self.resets = 0

    def probability(self, frame: bytes) -> float:
        assert len(frame) == 2 * self.frame_samples
        self.frames += 1
        return self.probabilities.pop(0) if self.probabilities else 0.0

    def reset(self) -> None:
        self.resets += 1


def run(probabilities, options=None, min_speech_ms=MIN_SPEECH_MS):
    """The events of the script's frames, then a second of 0.0 (20 ms frames)."""
    detector = VoiceActivityDetector(
        options or VadOptions(), model=Scripted(probabilities), min_speech_ms=min_speech_ms
    )
    # the resampler holds back about 1 ms: 2 ms more complete the last frame
    return detector.feed(bytes(MS * (20 * (len(probabilities) + 50) + 2)))


def frames(*runs: tuple[float, int]) -> list[float]:
    return [p for p, n in runs for _ in range(n)]


def test_speech_starts_at_its_first_frame_once_it_lasts():
    script = frames((0.0, 10), (0.9, 10), (0.0, 40))
    assert run(script, min_speech_ms=100) == [
        SpeechStarted(200),
        SilenceStarted(400),
        SpeechStopped(400),
    ]


def test_a_burst_shorter_than_the_minimum_is_no_speech():
    script = frames((0.0, 5), (0.9, 4), (0.0, 10), (0.9, 5), (0.0, 40))
    # 80 ms is short of 100; 100 ms is enough, and starts where it began
    assert run(script, min_speech_ms=100)[0] == SpeechStarted(380)
    assert run(frames((0.0, 5), (0.9, 4), (0.0, 40)), min_speech_ms=100) == []
    assert run(frames((0.0, 5), (0.9, 1), (0.0, 40)), min_speech_ms=0)[0] == SpeechStarted(100)


def test_probabilities_between_the_thresholds_hold_what_is_going_on():
    # a start needs the threshold, then stays a candidate above the exit threshold
    script = frames((0.4, 5), (0.6, 1), (0.4, 4), (0.0, 40))
    assert run(script, min_speech_ms=100)[0] == SpeechStarted(100)
    # after speech, in between is still speech; below the exit threshold is silence,
    # and in between does not end it
    script = frames((0.9, 10), (0.4, 20), (0.3, 2), (0.4, 30))
    assert run(script, min_speech_ms=0) == [
        SpeechStarted(0),
        SilenceStarted(600),
        SpeechStopped(600),
    ]


def test_a_pause_is_hinted_then_resumed_and_a_long_one_ends_the_turn():
    options = VadOptions(silence_duration_ms=500, speculate_after_ms=150)
    script = frames((0.9, 10), (0.0, 5), (0.9, 10), (0.0, 10), (0.9, 10), (0.0, 40))
    assert run(script, options, min_speech_ms=0) == [
        SpeechStarted(0),
        # 100 ms of silence at 200: no hint
        SilenceStarted(500),  # 150 ms after 500
        SpeechResumed(700),
        SilenceStarted(900),
        SpeechStopped(900),  # 500 ms after 900
    ]


def test_no_hint_when_speculation_is_off():
    options = VadOptions(speculate_after_ms=0)
    script = frames((0.9, 10), (0.0, 10), (0.9, 10), (0.0, 40))
    assert run(script, options, min_speech_ms=0) == [SpeechStarted(0), SpeechStopped(600)]


def test_the_hint_and_the_end_can_come_with_the_same_frame():
    options = VadOptions(silence_duration_ms=20, speculate_after_ms=10)
    script = frames((0.9, 5), (0.0, 5))
    assert run(script, options, min_speech_ms=0) == [
        SpeechStarted(0),
        SilenceStarted(100),
        SpeechStopped(100),
    ]


def test_audio_ms_counts_every_sample_and_reset_keeps_counting():
    model = Scripted(frames((0.9, 10), (0.0, 100)))
    detector = VoiceActivityDetector(model=model, min_speech_ms=0)
    assert detector.audio_ms == 0
    assert detector.feed(bytes(MS * 100 + 1)) == [SpeechStarted(0)]  # odd byte: kept
    assert detector.speaking
    assert detector.audio_ms == 100
    detector.reset()
    model.probabilities = []  # silence from now
    assert model.resets == 1
    assert not detector.speaking
    assert detector.audio_ms == 100
    assert detector.feed(b"\x00" + bytes(MS * 2000 - 1)) == []  # no end for a forgotten turn
    assert detector.audio_ms == 2100
    model.probabilities = frames((0.9, 10))
    # frames after a reset start where it was (less the 1 ms the resampler holds back)
    assert detector.feed(bytes(MS * 300)) == [SpeechStarted(2099)]
    assert detector.speaking


def test_reset_mid_frame_drops_the_part_frame():
    model = Scripted([0.0, 0.0] + [0.9] * 100)
    detector = VoiceActivityDetector(model=model, min_speech_ms=0)
    assert detector.feed(bytes(MS * 30)) == []  # one frame judged, 9 ms waiting (1 held)
    assert model.frames == 1
    detector.reset()
    assert detector.feed(bytes(MS * 21)) == []  # one frame, from 29 ms: the 9 are gone
    assert model.frames == 2
    assert detector.feed(bytes(MS * 20)) == [SpeechStarted(49)]


def test_the_default_model_is_silero_and_each_detector_has_its_own():
    assert isinstance(default_model(), SileroModel)
    one, two = VoiceActivityDetector(), VoiceActivityDetector()
    assert isinstance(one.model, SileroModel)
    assert one.model is not two.model


# -- real speech ------------------------------------------------------------------------------

#: Sentences without commas: eSpeak NG pauses only between them.
SENTENCES = (
    "Could you tell me what the weather will be like tomorrow morning?",
    "I would like to book a table for two at eight o'clock.",
    "Please remind me to call my sister after lunch.",
)


@functools.cache
def spoken(text: str) -> bytes:
    """``text`` by eSpeak NG at 24 kHz, from its first audible sample to its last."""
    espeak = ESpeak.get()
    resampler = Resampler(espeak.sample_rate, RATE)
    samples = np.frombuffer(resampler.feed(espeak.synthesize(text)) + resampler.flush(), "<i2")
    audible = np.flatnonzero(np.abs(samples.astype(np.int32)) > 100)
    return samples[audible[0] : audible[-1] + 1].tobytes()


@functools.cache
@functools.cache
def conversation() -> tuple[bytes, dict[str, float]]:
    """Two turns -- two sentences 250 ms apart, then one -- 1 s apart; and the truth (ms).

    Made once per process: eSpeak NG never reads a sentence the same way twice, and
    the tests that compare two feeds must feed the same audio."""
    parts, truth, at = [bytes(500 * MS)], {}, 500.0

    def say(text: str, name: str) -> None:
        nonlocal at
        pcm = spoken(text)
        parts.append(pcm)
        truth[f"{name} start"] = at
        at += len(pcm) / MS
        truth[f"{name} end"] = at

    def wait(ms: int) -> None:
        nonlocal at
        parts.append(bytes(ms * MS))
        at += ms

    say(SENTENCES[0], "first")
    wait(250)
    say(SENTENCES[1], "second")
    wait(1000)
    say(SENTENCES[2], "third")
    wait(1000)
    return b"".join(parts), truth


def feed_in(detector: VoiceActivityDetector, pcm: bytes, sizes: list[int]) -> list:
    events, at, index = [], 0, 0
    while at < len(pcm):
        size = sizes[index % len(sizes)]
        events += detector.feed(pcm[at : at + size])
        at += size
        index += 1
    return events


@pytest.mark.parametrize(
    ("make", "early", "late"),
    [(SileroModel, 20, 100), (lambda: WebRtcModel(3), 40, 150)],
    ids=["silero", "webrtc"],
)
def test_speech_with_pauses_gives_the_turns_in_order(make, early, late):
    pcm, truth = conversation()
    events = feed_in(VoiceActivityDetector(model=make()), pcm, [20 * MS])
    if make is not SileroModel:
        # WebRTC's ends come late (a median of +97 ms, tools/bench_vad.py): the
        # 250 ms pause's hint comes in some readings and not in others (eSpeak NG
        # never reads a sentence the same way twice). Its turns are checked.
        turns = [e for e in events if isinstance(e, (SpeechStarted, SpeechStopped))]
        assert [type(e) for e in turns] == [SpeechStarted, SpeechStopped] * 2, events
        first, end, second, end2 = turns
        for found, true in (
            (first.audio_start_ms, truth["first start"]),
            (end.audio_end_ms, truth["second end"]),
            (second.audio_start_ms, truth["third start"]),
            (end2.audio_end_ms, truth["third end"]),
        ):
            assert true - early <= found <= true + late, (found, true)
        return
    kinds = [type(e) for e in events]
    assert kinds == [
        SpeechStarted,
        SilenceStarted,  # the 250 ms pause: a hint ...
        SpeechResumed,  # ... cancelled
        SilenceStarted,
        SpeechStopped,
        SpeechStarted,
        SilenceStarted,
        SpeechStopped,
    ], events
    start, hint, resumed, _, end, start2, _, end2 = events

    def near(found: int, true: float) -> None:
        assert true - early <= found <= true + late, (found, true)

    near(start.audio_start_ms, truth["first start"])
    near(hint.audio_ms, truth["first end"])
    near(resumed.audio_ms, truth["second start"])
    near(end.audio_end_ms, truth["second end"])
    near(start2.audio_start_ms, truth["third start"])
    near(end2.audio_end_ms, truth["third end"])
    assert events[3].audio_ms == end.audio_end_ms
    assert events[6].audio_ms == end2.audio_end_ms


@functools.cache
def whole_events() -> list:
    pcm, _ = conversation()
    return VoiceActivityDetector().feed(pcm)


def test_twenty_ms_chunks_and_one_feed_agree():
    pcm, _ = conversation()
    assert feed_in(VoiceActivityDetector(), pcm, [20 * MS]) == whole_events()


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 12_000), max_size=7), st.integers(2_000, 12_000))
def test_any_chunking_gives_the_same_events(sizes, big):
    # sizes of any length (odd ones split samples), cycled; one big chunk a cycle keeps
    # the feeds few enough to be quick
    pcm, _ = conversation()
    assert feed_in(VoiceActivityDetector(), pcm, [*sizes, big]) == whole_events()


@pytest.mark.parametrize("make", [SileroModel, lambda: WebRtcModel(3)], ids=["silero", "webrtc"])
def test_silence_alone_is_no_speech(make):
    assert VoiceActivityDetector(model=make()).feed(bytes(10_000 * MS)) == []


@pytest.mark.parametrize("rms", [30, 300, 1500])
def test_noise_alone_is_no_speech(rms):
    noise = np.random.default_rng(rms).normal(0, rms, 10 * RATE)
    pcm = np.clip(np.rint(noise), -32768, 32767).astype("<i2").tobytes()
    detector = VoiceActivityDetector()
    assert feed_in(detector, pcm, [20 * MS]) == []
    assert not detector.speaking


def test_reset_forgets_a_turn_in_progress():
    pcm, truth = conversation()
    cut = int(truth["first start"] + 500) * MS
    detector = VoiceActivityDetector()
    assert [type(e) for e in detector.feed(pcm[:cut])] == [SpeechStarted]
    detector.reset()
    assert not detector.speaking
    rest = detector.feed(pcm[cut:])
    # the same sentence goes on: speech starts again (after the cut); the turns end as
    # before, to a frame (the frames after the reset begin at the cut)
    assert isinstance(rest[0], SpeechStarted)
    assert cut // MS - 1 <= rest[0].audio_start_ms <= cut // MS + 100
    turns = (SpeechStarted, SpeechStopped)
    after = [e for e in rest[1:] if isinstance(e, turns)]
    before = [e for e in whole_events()[1:] if isinstance(e, turns)]
    assert [type(e) for e in after] == [type(e) for e in before]
    for now, was in zip(after, before, strict=True):
        assert abs(attrs.astuple(now)[0] - attrs.astuple(was)[0]) <= 64  # two frames


def test_silero_streams_what_faster_whisper_computes_at_once():
    """The recurrent state carried frame to frame: the probabilities faster-whisper's
    batch call gives for the whole audio (but its last frame, whose last 64 samples
    faster-whisper zeroes in place)."""
    from faster_whisper.vad import get_vad_model

    pcm, _ = conversation()
    resampler = Resampler(RATE, 16_000)
    audio16 = resampler.feed(pcm) + resampler.flush()
    frames_ = len(audio16) // 1024
    audio16 = audio16[: frames_ * 1024]
    batch = get_vad_model()(np.frombuffer(audio16, "<i2").astype(np.float32) / 32768).reshape(-1)
    model = SileroModel()
    streamed = [model.probability(audio16[i : i + 1024]) for i in range(0, len(audio16), 1024)]
    assert np.allclose(streamed[:-1], batch[:-1], atol=1e-5)
    assert max(streamed) > 0.9
    assert min(streamed) < 0.1
    model.reset()
    assert model.probability(audio16[:1024]) == pytest.approx(streamed[0])
