"""``omni-trio bench --only voice``: a ``--quick`` run reports every figure of every
run and judges every goal, with numbers that make sense (in order, in range); the
goals are judged right at their limits; the saved run prints. Whether the goals are
met is the benchmark's business, not the tests'.

The quick run needs the voice extra, the serve extra and ``websockets`` (the voice
nox session has them): it skips without them, unless ``OMNI_TRIO_REQUIRE_VOICE=1``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

from omni_trio.bench._voice import (
    BARGE_IN_THINKER,
    QUESTIONS,
    SILENCE_MS,
    Sizes,
    content_words,
    quotes,
    recall,
    summary,
    voice_config,
)
from omni_trio.bench._voice_report import BARGE_IN_LIMIT, FIRST_AUDIO_LIMIT, goals
from omni_trio.cli import main
from voice_helpers import REQUIRE_VOICE, need_voice

SAVED = Path(__file__).parent.parent / "docs" / "results" / "bench-voice-python3.11.json"
GOAL_KEYS = [
    "turns.first_audio",
    "turns.isolation.speculate",
    "turns.isolation.no_speculation",
    "barge_in.request_ended",
    "barge_in.response_done",
    "barge_in.late_deltas",
]
MILESTONES = ("transcript", "first_text", "first_audio", "done")


def need_the_voice_bench() -> None:
    need_voice()
    missing = [m for m in ("hypercorn", "starlette", "websockets") if not importable(m)]
    if missing:
        message = f"the voice bench needs {', '.join(missing)}"
        if REQUIRE_VOICE:
            pytest.fail(f"{message} (and OMNI_TRIO_REQUIRE_VOICE=1)", pytrace=False)
        pytest.skip(message)


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_summary(figures: dict[str, float], count: int) -> None:
    assert figures["count"] == count
    assert figures["min"] <= figures["p50"] <= figures["p90"] <= figures["p99"] <= figures["max"]
    assert figures["min"] <= figures["mean"] <= figures["max"]
    assert all(math.isfinite(value) for value in figures.values())


def check_turns(run: dict[str, Any], sessions: int, turns: int) -> None:
    assert (run["sessions"], run["turns_per_session"]) == (sessions, turns)
    assert run["turns"] == len(run["each"]) == sessions * turns
    assert run["completed"] == run["turns"]
    assert run["missing"] == dict.fromkeys(MILESTONES, 0)
    assert run["isolation"]["sessions"] == sessions
    assert 0 <= run["isolation"]["passed"] <= sessions
    assert run["responses"]["started"] >= run["turns"]
    for key in (*MILESTONES, "hangover", "vad_end_offset", "detect_delay", "stopped_transit"):
        check_summary(run[key], run["turns"])
    for turn in run["each"]:
        assert turn["question"] in QUESTIONS
        assert 0.0 <= turn["recall"] <= 1.0
        # an answer's events come in order after speech_stopped
        assert 0 <= turn["first_text"] <= turn["first_audio"] <= turn["done"] < 30
        assert 0 <= turn["transcript"] <= turn["first_text"]
        # the VAD heard the question end where it did: no sooner than its hangover
        # after the speech's last chunk, and it placed that end near the real one
        assert SILENCE_MS / 1e3 <= turn["hangover"] + 0.1 < 2.0
        assert -0.2 < turn["vad_end_offset"] < 0.3
        assert 0 <= turn["detect_delay"] < 0.5
        assert 0 <= turn["stopped_transit"] < 0.5
    assert all(0 <= share < 4 for share in run["cpu"].values() if share is not None)


def test_a_quick_run_reports_every_figure_and_judges_every_goal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    need_the_voice_bench()
    assert main(["bench", "--only", "voice", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quick"] is True
    assert report["command"].startswith("omni-trio ")
    assert not {"results", "process", "replicas", "ray", "ray_skipped"} & report.keys()
    voice = report["voice"]
    sizes = Sizes.quick()

    turns = voice["results"]["turns"]
    assert turns["silence_duration_ms"] == SILENCE_MS
    assert set(turns["runs"]) == {"speculate", "no_speculation"}
    for runs in turns["runs"].values():
        assert set(runs) == {str(s) for s in sizes.sessions}
        for sessions, count in zip(sizes.sessions, sizes.turns, strict=True):
            check_turns(runs[str(sessions)], sessions, count)
    # without speculation, recognition starts at speech_stopped: its transcript after
    for run in turns["runs"]["no_speculation"].values():
        assert run["transcript"]["min"] > 0

    barge_in = voice["results"]["barge_in"]
    assert barge_in["thinker"]["tokens_per_second"] == BARGE_IN_THINKER["tokens_per_second"]
    assert barge_in["trials"] == len(barge_in["each"]) == sizes.trials
    assert barge_in["late_deltas"] == 0  # none, ever: the server drops them
    assert barge_in["responses"]["cancelled"] >= barge_in["interrupted"]
    for trial in barge_in["each"]:
        assert trial["late_deltas"] == 0
        if trial["status"] != "cancelled":
            continue
        # the server's steps, from the VAD's decision, in the order the session takes them
        assert 0 <= trial["cancelled"] <= trial["request_ended"] <= trial["response_done"] < 1
        assert trial["request_ended"] <= trial["let_go"] < 3
        assert 0 < trial["poll_round"] < 1
        assert 0 <= trial["started_transit"] < 1
        assert 0 <= trial["client_done"] < 1
        assert 0 < trial["vad_delay"] < 1  # the VAD waits for a little speech
    for key in ("request_ended", "response_done", "let_go", "client_done", "vad_delay"):
        check_summary(barge_in[key], barge_in["interrupted"])

    rows = voice["goals"]
    assert [row["key"] for row in rows] == GOAL_KEYS
    for row in rows:
        assert isinstance(row["value"], float)
        assert math.isfinite(row["value"])
        assert row["value"] >= 0
        assert isinstance(row["met"], bool)

    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(report))
    assert main(["bench", "--from", str(saved)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert out.startswith("$ omni-trio ")
    assert "Turns, at the client (ms)" in out
    assert "Barge-in: " in out
    assert f"Voice goals met: {sum(row['met'] for row in rows)} of {len(rows)}" in out
    for row in rows:
        assert f"goal {row['goal']}: " in out


def test_the_cli_offers_voice_to_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--only", "voices"]) == 2
    assert "'voice'" in capsys.readouterr().err  # the choices, which name it


def test_only_voice_says_what_is_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import omni_trio.bench._voice_report as voice_report

    missing = "the voice scenarios need websockets, which is not installed: pip install x"
    monkeypatch.setattr(voice_report, "voice_missing", lambda: missing)
    assert main(["bench", "--only", "voice"]) == 2
    assert capsys.readouterr().err == f"omni-trio bench: --only voice: {missing}\n"


def test_the_saved_run_prints_with_its_goals(capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(SAVED.read_text())
    assert report["command"] == "omni-trio bench --only voice --json"
    assert report["quick"] is False
    assert main(["bench", "--from", str(SAVED)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert out.startswith("$ omni-trio bench --only voice --json Python 3.11")
    rows = report["voice"]["goals"]
    assert [row["key"] for row in rows] == GOAL_KEYS
    assert f"Voice goals met: {sum(row['met'] for row in rows)} of {len(rows)}" in out
    runs = report["voice"]["results"]["turns"]["runs"]
    assert set(runs["speculate"]) == set(runs["no_speculation"]) == {"1", "10"}
    assert report["voice"]["results"]["barge_in"]["trials"] == 50
    for row in rows:
        assert f"goal {row['goal']}: " in out


# -- the goals, judged ------------------------------------------------------------------------


def results_with(
    first_audio: float, passed: int, request_ended: float, response_done: float, late: int
) -> dict[str, Any]:
    def run(sessions: int, passed: int) -> dict[str, Any]:
        return {
            "first_audio": {"p90": first_audio},
            "isolation": {"sessions": sessions, "passed": passed},
        }

    by_sessions = {"1": run(1, 1), "10": run(10, passed)}
    return {
        "turns": {"runs": {"speculate": by_sessions, "no_speculation": copy.deepcopy(by_sessions)}},
        "barge_in": {
            "trials": 50,
            "interrupted": 50,
            "late_deltas": late,
            "request_ended": {"p99": request_ended},
            "response_done": {"p99": response_done},
        },
    }


@pytest.mark.parametrize(
    ("figures", "unmet"),
    [
        ((0.3, 10, 0.002, 0.003, 0), set()),
        ((FIRST_AUDIO_LIMIT, 10, BARGE_IN_LIMIT, BARGE_IN_LIMIT, 0), set()),  # at the limits
        ((FIRST_AUDIO_LIMIT + 1e-6, 10, 0.002, 0.003, 0), {"turns.first_audio"}),
        (
            (0.3, 9, 0.002, 0.003, 0),
            {"turns.isolation.speculate", "turns.isolation.no_speculation"},
        ),
        ((0.3, 10, BARGE_IN_LIMIT + 1e-6, 0.003, 0), {"barge_in.request_ended"}),
        ((0.3, 10, 0.002, BARGE_IN_LIMIT + 1e-6, 0), {"barge_in.response_done"}),
        ((0.3, 10, 0.002, 0.003, 1), {"barge_in.late_deltas"}),
    ],
)
def test_the_goals_are_judged_at_their_limits(
    figures: tuple[float, int, float, float, int], unmet: set[str]
) -> None:
    rows = goals(results_with(*figures))
    assert [row["key"] for row in rows] == GOAL_KEYS
    assert {row["key"] for row in rows if not row["met"]} == unmet
    by_key = {row["key"]: row for row in rows}
    assert by_key["turns.first_audio"]["value"] == figures[0]
    assert by_key["turns.isolation.speculate"]["value"] == figures[1]
    assert by_key["barge_in.late_deltas"]["value"] == figures[4]


def test_barge_in_is_unmet_when_an_answer_was_not_interrupted() -> None:
    results = results_with(0.3, 10, 0.002, 0.003, 0)
    results["barge_in"]["interrupted"] = 49
    rows = {row["key"]: row for row in goals(results)}
    assert not rows["barge_in.request_ended"]["met"]
    assert not rows["barge_in.response_done"]["met"]


# -- the parts ---------------------------------------------------------------------------------


def test_a_summary_has_its_mean_and_percentiles() -> None:
    found = summary([0.4, 0.1, 0.3, 0.2])
    assert found == {
        "count": 4,
        "mean": pytest.approx(0.25),
        "min": 0.1,
        "p50": pytest.approx(0.25),
        "p90": 0.4,
        "p99": 0.4,
        "max": 0.4,
    }
    ranks = summary([float(i) for i in range(1, 101)])
    assert (ranks["p90"], ranks["p99"]) == (90.0, 99.0)
    assert summary([-0.05, 0.01])["min"] == -0.05  # recognition may end before speech_stopped


def test_a_transcript_is_judged_by_its_content_words_and_the_answer_by_its_quote() -> None:
    assert content_words("What is the capital city of France?") == ["capital", "city", "france"]
    assert recall("What is the capital city of France?", "what is the capital city on France.") == 1
    assert recall("How far is the moon from the earth?", "How far is the movement?") == 1 / 3
    heard = "Which planet is the largest in our solar system"
    assert quotes(f"You said: {heard}. The lighthouse keeper ", heard)
    assert quotes("You said: Is it. The ", "Is it,")  # the thinker ends a quote as a sentence
    assert not quotes("You said: something else. ", heard)
    assert not quotes("I did not hear anything. ", "")


def test_the_voice_config_overrides_the_thinker_alone() -> None:
    config = voice_config(**BARGE_IN_THINKER)
    shipped = voice_config()
    assert config.stages[1].engine_args == {
        **shipped.stages[1].engine_args,
        **BARGE_IN_THINKER,
    }
    for stage, other in zip(config.stages, shipped.stages, strict=True):
        if stage.name != "thinker":
            assert stage == other


def test_the_sizes() -> None:
    full, quick = Sizes.full(), Sizes.quick()
    assert (full.sessions, full.trials) == ((1, 10), 50)
    assert len(full.turns) == len(full.sessions)
    assert len(quick.turns) == len(quick.sessions)
    assert len(QUESTIONS) >= max(full.sessions)  # every session asks its own question
