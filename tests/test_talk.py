"""``omni-trio talk``: one turn on a running server's ``/v1/realtime``, spoken or
typed, against the scripted listening pipeline (its voice activity detector hears
loudness, so the turn ends exactly where the file's trailing silence says); the
command itself in a process of its own, as a user runs it: its lines, its saved
answer, and its one line and exit status when something is wrong."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import pytest
import trio

from omni_trio._audio import wav_bytes
from omni_trio.serve import RealtimeOptions
from omni_trio.serve._client import ClientError, Server
from omni_trio.serve._talk import RATE, TRAILING_SILENCE_MS, spoken_pcm, talk
from realtime_helpers import WORD_AUDIO, WORDS, LoudnessDetector, answer_words, realtime_server

pytest.importorskip("av")

#: A "spoken" question for the loudness detector: 600 ms of sound.
QUESTION_MS = 600


def question_wav(path: Path, rate: int = 16_000) -> Path:
    """600 ms of "speech" as a WAV at ``rate`` (talk resamples it to 24 kHz)."""
    path.write_bytes(wav_bytes(b"\x00\x10" * (rate * QUESTION_MS // 1000), rate))
    return path


def options() -> RealtimeOptions:
    return RealtimeOptions(detector=LoudnessDetector)


async def test_a_spoken_turn_is_heard_and_answered(tmp_path: Path) -> None:
    pcm = spoken_pcm(question_wav(tmp_path / "q.wav").read_bytes())
    # resampled to 24 kHz, with a second of silence after it
    assert len(pcm) == 2 * RATE * (QUESTION_MS + TRAILING_SILENCE_MS) // 1000
    seen: list[str] = []
    async with realtime_server(options=options()) as server:
        turn = await talk(
            Server.of(server.url), pcm=pcm, on_event=lambda what, t: seen.append(what)
        )
    assert turn.heard == f"{QUESTION_MS} ms of audio"
    assert turn.answer == "".join(answer_words(turn.heard))
    assert turn.audio == WORD_AUDIO * WORDS
    assert seen == ["heard", "first_audio", "done"]
    assert turn.first_audio is not None
    assert turn.done is not None
    assert 0 <= turn.first_audio <= turn.done


async def test_a_typed_turn_is_answered() -> None:
    async with realtime_server(options=options()) as server:
        turn = await talk(Server.of(server.url), text="hello there")
    assert turn.heard is None
    assert turn.answer == "".join(answer_words("hello there"))
    assert turn.audio == WORD_AUDIO * WORDS


async def test_a_refused_session_and_an_unreachable_server_are_client_errors() -> None:
    async with realtime_server(options=options()) as server:
        with pytest.raises(ClientError, match="model: this server serves 'omni-listening"):
            await talk(Server.of(server.url), text="hi", model="gpt-realtime")
    port = Server.of(server.url).port  # closed now
    with pytest.raises(
        ClientError, match=f"cannot connect to 127.0.0.1:{port}: connection refused"
    ):
        await talk(Server("127.0.0.1", port), text="hi")


def test_a_url_that_is_not_a_servers_is_refused() -> None:
    assert Server.of("localhost:9000") == Server("localhost", 9000)
    assert Server.of("ws://127.0.0.1") == Server("127.0.0.1", 8000)
    with pytest.raises(ClientError, match="is not a server's URL"):
        Server.of("ftp://example")


# -- the command, in a process of its own ------------------------------------------------


async def run_talk(*args: str) -> subprocess.CompletedProcess[str]:
    return await trio.run_process(
        [sys.executable, "-m", "omni_trio", "talk", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def test_omni_trio_talk_prints_both_sides_and_saves_the_answer(tmp_path: Path) -> None:
    question = question_wav(tmp_path / "q.wav", rate=44_100)
    answer = tmp_path / "answer.wav"
    async with realtime_server(options=options()) as server:
        done = await run_talk(server.url, "--wav", str(question), "--save", str(answer))
    out = done.stdout.decode()
    assert (done.returncode, done.stderr.decode()) == (0, ""), out
    you, assistant, saved = out.splitlines()
    assert you.startswith("you (heard ")
    assert you.endswith(f": {QUESTION_MS} ms of audio")
    assert assistant.startswith("assistant (first audio ")
    assert assistant.endswith("".join(answer_words(f"{QUESTION_MS} ms of audio")))
    assert saved == f"saved {answer} ({WORDS * 0.1:.1f} s of audio)"
    with wave.open(str(answer)) as wav:
        assert (wav.getframerate(), wav.readframes(wav.getnframes())) == (
            RATE,
            WORD_AUDIO * WORDS,
        )


@pytest.mark.parametrize(
    ("args", "status", "said"),
    [
        (["--text", "hi"], 1, "cannot connect to 127.0.0.1:{port}: connection refused"),
        (["--wav", "{readme}"], 2, "is not audio FFmpeg can decode"),
        (["--wav", "{missing}"], 2, "--wav: cannot read"),
        (["--text", " "], 2, "--text must not be empty"),
        (["--text", "hi", "--model", "nope"], 1, "model: this server serves"),
    ],
    ids=["refused", "not audio", "no file", "empty text", "wrong model"],
)
async def test_omni_trio_talk_says_what_is_wrong_in_one_line(
    tmp_path: Path, args: list[str], status: int, said: str
) -> None:
    readme = Path(__file__).parents[1] / "README.md"
    filled = [a.format(readme=readme, missing=tmp_path / "none.wav") for a in args]
    async with realtime_server(options=options()) as server:
        # a server that refuses the model; else port 1, where nothing listens
        url = server.url if "--model" in args else "http://127.0.0.1:1"
        done = await run_talk(url, *filled)
    err = done.stderr.decode()
    assert done.returncode == status, err
    assert err.count("\n") == 1, err
    assert err.startswith("omni-trio talk: ")
    assert said.format(port=1) in err
