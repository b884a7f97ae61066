"""The shipped ``subtitled`` pipeline: a stage graph a user can see. The thinker's
words go to the talker and to the subtitles, the talker's codes to code2wav and to
the subtitles; the subtitles read both (a fan-in) and time each phrase by its codes,
so the cues cover the answer, in order, and end where the audio does."""

from __future__ import annotations

import msgspec
import pytest
import trio

from helpers import END_TO_END
from omni_trio import open_pipeline
from omni_trio.cli import main
from omni_trio.config import shipped_pipeline
from omni_trio.demo.engines import FRAME_SECONDS, SAMPLE_RATE, cue, response_tokens

pytestmark = pytest.mark.filterwarnings("error")

PROMPT = "Tell me about the sea"
WORDS = 12


def subtitled(async_chunk: bool = True):
    """The shipped config, its thinker unpaced and short."""
    config = shipped_pipeline("subtitled").with_mode(async_chunk)
    thinker, *rest = config.stages
    fast = {"tokens_per_second": 1000, "max_tokens": WORDS, "whole_sentences": True}
    thinker = msgspec.structs.replace(thinker, engine_args=fast)
    talker = msgspec.structs.replace(rest[0], engine_args={"codes_per_second": 1e6})
    return msgspec.structs.replace(config, stages=[thinker, talker, *rest[1:]])


def seconds(stamp: str) -> float:
    minutes, rest = stamp.split(":")
    return int(minutes) * 60 + float(rest)


def parse(cues):
    """``(start, end, text)`` of each cue."""
    parsed = []
    for each in cues:
        timing, text = each.split("\n")
        start, end = timing.split(" --> ")
        parsed.append((seconds(start), seconds(end), text))
    return parsed


def test_a_cue_is_webvtt():
    assert cue(0.0, 1.28, "Hello there") == "00:00.000 --> 00:01.280\nHello there"
    assert cue(3725.5, 3726.0, "late").startswith("01:02:05.500 --> 01:02:06.000")


@pytest.mark.parametrize("async_chunk", [True, False], ids=["async_chunk", "forward"])
async def test_the_subtitles_cover_the_answer_and_end_with_the_audio(async_chunk):
    async with open_pipeline(subtitled(async_chunk)) as pipeline:
        with trio.fail_after(30):
            async with pipeline.orchestrator.open_request(PROMPT) as stream:
                outs = [out async for out in stream if out.data is not None]
    assert stream.terminal.finish_reason == "completed"
    words = response_tokens(PROMPT, WORDS, whole_sentences=True)
    text = "".join(out.data for out in outs if out.stage_id == 0)
    audio = sum(len(out.data) for out in outs if out.stage_id == 2)
    cues = parse(out.data for out in outs if out.stage_id == 3)
    assert text == "".join(words)
    assert " ".join(words_ for _, _, words_ in cues).split() == text.split()
    assert all(start < end for start, end, _ in cues)
    assert [start for start, _, _ in cues[1:]] == [end for _, end, _ in cues[:-1]]
    assert cues[0][0] == 0.0
    assert cues[-1][1] == pytest.approx(audio / 2 / SAMPLE_RATE)
    assert cues[-1][1] == pytest.approx(len(words) * 4 * FRAME_SECONDS)  # 4 codes a word
    assert all(len(words_.split()) <= 7 for _, _, words_ in cues)


async def test_a_text_only_request_never_reaches_the_talker_or_the_subtitles():
    async with open_pipeline(subtitled()) as pipeline:
        with trio.fail_after(30):
            async with pipeline.orchestrator.open_request(PROMPT, final_stage_ids=[0]) as stream:
                outs = [out async for out in stream if out.data is not None]
            assert {out.stage_id for out in outs} == {0}
            assert stream.terminal.finish_reason == "completed"
            for stage in pipeline.stages[1:]:
                await stage.refresh_statistics()
                assert stage.statistics().worker_requests == 0


@END_TO_END
def test_run_prints_the_subtitles_and_writes_them_as_webvtt(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["run", "subtitled", "--prompt", PROMPT, "--wav", "out.wav", "--vtt", "out.vtt"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    vtt = (tmp_path / "out.vtt").read_text()
    assert vtt.startswith("WEBVTT\n\n00:00.000 --> ")
    first = vtt.split("\n\n")[1]
    timing, words = first.split("\n")
    assert f"[{timing}] {words}" in printed
    assert "subtitles written to out.vtt" in printed


def test_vtt_needs_a_subtitles_stage(capsys):
    assert main(["run", "demo", "--prompt", "x", "--vtt", "out.vtt"]) == 2
    assert "--vtt needs a subtitles final stage, demo has none" in capsys.readouterr().err


def test_subtitles_alone_run_the_thinker_the_talker_and_the_subtitles():
    """docs/config.md: ``final_stage_ids=[3]`` runs stages 0, 1 and 3, not code2wav."""
    graph = shipped_pipeline("subtitled").graph
    assert sorted(graph.route(finals=[3]).stages) == [0, 1, 3]
    assert sorted(graph.route(finals=[0, 2]).stages) == [0, 1, 2]  # what the server asks
