"""``omni-trio bench --only priority``: the aging part's quick run lets nothing starve
and keeps every low-priority wait within its bound; a ``--quick`` run of the whole
bench reports every figure and judges every goal; the goals are judged right at
their limits; the saved run prints; the device's slot ages as it is told (on Trio's
virtual clock). Whether the served assistant's goals are met is the benchmark's
business, not the tests'.

The aging part needs nothing but worker processes: a benchmark's smoke run, on the
full-size Python. The whole bench serves the assistant: it needs the llm extra and
the model and what the voice bench needs, and skips without them, unless
``OMNI_TRIO_REQUIRE_LLM=1`` (or ``OMNI_TRIO_REQUIRE_VOICE=1``).
"""

from __future__ import annotations

import json
import math
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from helpers import ONLY_FULL_SIZE
from llm_helpers import need_llm
from omni_trio.bench._device import Device
from omni_trio.bench._priority import (
    AGING_S,
    GOALS,
    P_HIGH,
    P_LOW,
    Sizes,
    bound_of,
    goals,
)
from omni_trio.bench._priority import main as priority_main
from omni_trio.cli import main
from test_bench_voice import importable, need_the_voice_bench

SAVED = Path(__file__).parent.parent / "docs" / "results" / "bench-priority-python3.11.json"
#: The loaded machine's late wake-ups: a worker that wakes more than a step late
#: starts its steps afresh, and its request waits that much more than the bound.
LATE_WAKE_UPS = 1.25


def check_summary(figures: dict[str, float], count: int) -> None:
    assert figures["n"] == count
    assert 0 < figures["p50"] <= figures["p90"] <= figures["max"]
    assert all(math.isfinite(value) for value in figures.values())


def check_aging(aging: dict[str, Any], sizes: Sizes) -> None:
    assert aging["window"] == (P_LOW - P_HIGH) * AGING_S
    assert aging["offered_load"] == pytest.approx(sizes.step_seconds / sizes.high_interval)
    assert aging["offered_load"] > 1  # an overload: strict priority starves the others
    aged, strict = aging["aged"], aging["strict"]
    assert (aged["aging_s"], strict["aging_s"]) == (AGING_S, None)
    highs = round(sizes.stream_seconds / sizes.high_interval)
    lows = round(sizes.stream_seconds / sizes.low_interval)
    for run in (aged, strict):
        assert run["requests"] == {"high": highs, "low": lows}
        check_summary(run["low_wait"], lows)
        check_summary(run["low_first_output"], lows)
        assert run["high_wait"]["n"] == highs
        assert 0 <= run["low_completed_in_stream"] <= lows
        assert run["low_rate"] == run["low_completed_in_stream"] / sizes.stream_seconds
    # aged: the low-priority requests get through while the overload lasts, none is
    # overtaken by a request that came after its window (exact: the device's clock
    # and the order of its slot), and the longest wait is within its bound
    assert aged["low_rate"] > 0
    assert aged["overtaken_late"] == 0
    assert aged["farthest_overtaker"] < aging["window"] + 1e-3
    longest = aged["longest"]
    assert longest["waited"] == aged["low_wait"]["max"]
    assert longest["bound"] >= (longest["held"] + 1) * sizes.step_seconds
    assert 0 < longest["waited"] / longest["bound"] <= aged["wait_over_bound"]
    assert aged["wait_over_bound"] <= LATE_WAKE_UPS
    # strict: overtaken from start to end of the stream, they wait for its backlog
    assert strict["low_completed_in_stream"] < aged["low_completed_in_stream"]
    assert strict["farthest_overtaker"] > aging["window"]
    assert strict["overtaken_late"] > 0
    assert "longest" not in strict


@ONLY_FULL_SIZE
def test_the_aging_part_lets_nothing_starve(capsys: pytest.CaptureFixture[str]) -> None:
    priority_main(["--part", "aging", "--quick"])
    results = json.loads(capsys.readouterr().out)
    assert list(results) == ["aging"]
    check_aging(results["aging"], Sizes.quick())


def check_chat(chat: dict[str, Any], sizes: Sizes) -> None:
    assert (chat["load_chats"], chat["load_tokens"]) == (sizes.chats, sizes.load_tokens)
    ours, base = chat["prioritised"], chat["baseline"]
    assert (ours["reserved_slots"], base["reserved_slots"]) == (1, 0)
    assert (ours["urgent_priority"], ours["load_priority"]) == (-10, 10)
    assert (base["urgent_priority"], base["load_priority"]) == (0, 0)
    assert ours["urgent_slot_wait"]["requests"] == 2 * sizes.rounds  # a chat and a turn each
    for server, rounds in ((ours, sizes.rounds), (base, sizes.baseline_rounds)):
        for kind in ("chat", "turn"):
            figures = server[kind]
            check_summary(figures["idle"], rounds)
            check_summary(figures["busy"], rounds)
            ratio = figures["busy"]["p50"] / figures["idle"]["p50"]
            assert figures["busy_over_idle"] == pytest.approx(ratio)
            assert len(figures["load_generating"]) == rounds
            assert all(0 <= n <= server["n_parallel"] for n in figures["load_generating"])
        # a spoken turn is heard (Whisper) before it is answered: later than a chat
        assert server["turn"]["idle"]["p50"] > server["chat"]["idle"]["p50"]
        # the urgent requests' wait for a thinker slot, as the thinker says: every one
        # counted (on the baseline, the load's chats that ended too: the same priority)
        assert server["urgent_slot_wait"]["requests"] >= 2 * rounds
        assert server["urgent_slot_wait"]["mean"] >= 0
        assert server["load"]["chats_started"] >= sizes.chats
        assert server["load"]["tokens_ended"] >= 0


def test_a_quick_run_reports_every_figure_and_judges_every_goal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    need_llm()
    need_the_voice_bench()
    if not importable("httpx"):
        pytest.skip("the priority bench asks the server with httpx")
    assert main(["bench", "--only", "priority", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quick"] is True
    assert report["command"].startswith("omni-trio ")
    assert not {"results", "process", "replicas", "ray", "voice", "llm", "audio"} & report.keys()
    priority = report["priority"]
    sizes = Sizes.quick()
    check_chat(priority["results"]["chat"], sizes)
    check_aging(priority["results"]["aging"], sizes)
    rows = priority["goals"]
    assert [row["key"] for row in rows] == list(GOALS)
    for row in rows:
        assert isinstance(row["value"], float)
        assert math.isfinite(row["value"])
        assert isinstance(row["met"], bool)
    assert rows == goals(priority["results"])

    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(report))
    assert main(["bench", "--from", str(saved)]) == 0
    check_printed(capsys.readouterr().out, report)


def check_printed(printed: str, report: dict[str, Any]) -> None:
    out = " ".join(printed.split())  # rich wraps at the terminal width
    assert out.startswith(f"$ {report['command']} Python ")
    assert "The assistant beside " in out
    assert "With priority: the urgent requests -10, the chats 10, 1 of the thinker's 4 " in out
    assert "without: every request 0, 0 reserved." in out
    assert "Aging on a device of one slot" in out
    rows = report["priority"]["goals"]
    assert f"Priority goals met: {sum(row['met'] for row in rows)} of {len(rows)}" in out
    for row in rows:
        assert f"{row['goal']}: {row['shown']}" in out


def test_the_saved_run_prints_with_its_goals(capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(SAVED.read_text())
    assert report["command"] == "omni-trio bench --only priority --json"
    assert report["quick"] is False
    assert main(["bench", "--from", str(SAVED)]) == 0
    check_printed(capsys.readouterr().out, report)
    results = report["priority"]["results"]
    assert report["priority"]["goals"] == goals(results)
    check_chat(results["chat"], Sizes.full())
    check_aging(results["aging"], Sizes.full())


def test_the_cli_offers_priority_to_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--only", "priorities"]) == 2
    assert "'priority'" in capsys.readouterr().err  # the choices, which name it


def test_only_priority_says_what_is_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import omni_trio.bench._llm_report as llm_report
    import omni_trio.bench._priority as bench_priority

    missing = "the language model's scenarios need xllamacpp, which is not installed: pip x"
    monkeypatch.setattr(llm_report, "llm_missing", lambda: missing)
    monkeypatch.setattr(bench_priority, "importable", lambda module: module != "httpx")
    assert main(["bench", "--only", "priority"]) == 2
    assert capsys.readouterr().err == (
        "omni-trio bench: --only priority: the priority scenarios need httpx, which is "
        "not installed: pip install 'omni-trio[serve]' httpx; xllamacpp, which is not "
        "installed: pip x\n"
    )


def results_with(ttft_ratio: float, low_rate: float, late: int, over: float) -> dict[str, Any]:
    chat = {"prioritised": {"chat": {"busy_over_idle": ttft_ratio}}}
    aged = {"low_rate": low_rate, "overtaken_late": late, "wait_over_bound": over}
    return {"chat": chat, "aging": {"aged": aged}}


@pytest.mark.parametrize(
    ("figures", "unmet"),
    [
        ((1.2, 5.0, 0, 0.9), set()),
        ((1.5, 0.001, 0, 1.0), set()),  # at the limits
        ((1.51, 5.0, 0, 0.9), {"priority.urgent_ttft_busy_over_idle"}),
        ((1.2, 0.0, 0, 0.9), {"priority.aging_low_rate"}),
        ((1.2, 5.0, 1, 0.9), {"priority.aging_overtaken_late"}),
        ((1.2, 5.0, 0, 1.01), {"priority.aging_wait_over_bound"}),
    ],
)
def test_the_goals_are_judged_at_their_limits(
    figures: tuple[float, float, int, float], unmet: set[str]
) -> None:
    rows = goals(results_with(*figures))
    assert [row["key"] for row in rows] == list(GOALS)
    assert {row["key"] for row in rows if not row["met"]} == unmet
    assert [row["value"] for row in rows] == [float(f) for f in figures]


def test_a_low_priority_requests_bound_counts_the_urgent_ones_within_its_window() -> None:
    low = {"priority": 2, "arrived": 10.0, "held": 3}
    others = [
        low,
        {"priority": 0, "arrived": 9.9},  # before it: in its held, not an overtaker
        {"priority": 0, "arrived": 10.2},
        {"priority": 0, "arrived": 10.49},
        {"priority": 0, "arrived": 10.51},  # after its window: (2 - 0) * 0.25 s
        {"priority": 1, "arrived": 10.2},  # window 0.25 s: in it
        {"priority": 1, "arrived": 10.3},  # out of it
        {"priority": 2, "arrived": 10.1},  # its own priority: never ahead
    ]
    bound, overtakers = bound_of(low, others, 0.25, 0.020)
    assert overtakers == 3
    assert bound == pytest.approx((3 + 3 + 1) * 0.020)


# -- the device's slot, aged, on Trio's virtual clock -----------------------------------------


async def served_order(device: Device, low_at: float) -> tuple[int, list[float]]:
    """One-step urgent requests (priority 0) every 10 ms from 0 to 1 s, and one of
    priority 2 at ``low_at``: the low one's order at the slot, and the urgent ones'
    starts in order."""
    found: dict[float, int] = {}

    async def request(at: float, priority: int) -> None:
        await trio.sleep(at)
        outputs = device.run(1, priority)
        async with aclosing(outputs):
            async for out in outputs:
                found[at if priority == P_HIGH else -1.0] = out["order"]
                break  # as a worker does at the engine's last output: it closes it

    async with trio.open_nursery() as nursery:
        for index in range(101):
            nursery.start_soon(request, index * 0.010, P_HIGH)
        nursery.start_soon(request, low_at, P_LOW)
    low = found.pop(-1.0)
    return low, sorted(found, key=found.__getitem__)


async def test_the_device_slot_ages_its_waiters(autojump_clock: trio.testing.MockClock) -> None:
    device = Device(step_seconds=0.020, batch=1, priority_aging_s=0.25)
    low, highs = await served_order(device, 0.0051)
    # its window is (2 - 0) * 0.25 = 0.5 s: the urgent ones up to 0.50 go first
    # (0.50 came 0.4949 s after it), those from 0.51 on after it
    ahead = [at for at in highs if at < 0.5051]
    assert low == len(ahead)
    assert highs == sorted(highs)  # the urgent ones among themselves: in order


async def test_the_device_slot_without_aging_is_strict(
    autojump_clock: trio.testing.MockClock,
) -> None:
    device = Device(step_seconds=0.020, batch=1, priority_aging_s=None)
    low, highs = await served_order(device, 0.0051)
    assert low == len(highs)  # after every urgent request: starved while they come
