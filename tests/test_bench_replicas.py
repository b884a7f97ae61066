"""``omni-trio bench --only replicas``: a ``--quick`` run's report has every level of
every replica count and every goal judged, the goals are judged right, the saved run
prints, and the device-time engines keep time as they say (on Trio's virtual clock).
Whether the goals are met is the benchmark's business, not the tests'."""

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
from omni_trio.bench._device import Device
from omni_trio.bench._replicas import Sizes, speech_config, summary
from omni_trio.bench._replicas_report import BATCHES, comparison, goals, speech_installed
from omni_trio.cli import main

SAVED = Path(__file__).parent.parent / "docs" / "results" / "bench-replicas-python3.11.json"


def check_summary(figures: dict[str, float]) -> None:
    assert set(figures) == {"mean", "p50", "p90", "max"}
    assert 0 < figures["p50"] <= figures["p90"] <= figures["max"]
    assert figures["mean"] <= figures["max"]


@ONLY_FULL_SIZE
def test_a_quick_run_reports_every_level_and_judges_every_goal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["bench", "--only", "replicas", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quick"] is True
    assert report["command"].startswith("omni-trio ")
    assert not {"results", "process", "ray", "ray_skipped"} & report.keys()  # replicas alone
    pools = report["replicas"]
    sizes = Sizes.quick()

    device = pools["results"]["device"]
    assert set(device) == {str(batch) for batch in BATCHES}
    for batch, part in device.items():
        assert part["batch"] == int(batch)
        assert part["concurrency"] == list(sizes.concurrency)
        assert set(part["replicas"]) == {str(r) for r in sizes.replicas}
        for replicas, run in part["replicas"].items():
            assert run["restarts"] == 0
            assert set(run["levels"]) == {str(c) for c in sizes.concurrency}
            for concurrency, level in run["levels"].items():
                assert level["requests"] == sizes.requests(int(concurrency))
                # every request ran on one of the stage's replicas
                assert len(level["per_replica"]) == int(replicas)
                assert sum(level["per_replica"]) == level["requests"]
                assert 0 <= level["queued"] <= level["requests"]
                assert level["rate"] == pytest.approx(level["requests"] / level["wall"])
                assert level["outputs_rate"] == pytest.approx(level["rate"] * sizes.steps)
                check_summary(level["first_output"])
                check_summary(level["e2e"])
                # a request's first output comes before its end
                assert level["first_output"]["max"] <= level["e2e"]["max"]
                assert level["first_output"]["mean"] <= level["e2e"]["mean"]
            # one request at a time, alone: nothing ever waited for a slot
            assert run["levels"]["1"]["queued"] == 0

    if speech_installed():
        speech = pools["results"]["speech"]
        assert (speech["mode"], speech["concurrency"]) == ("forward", sizes.speech_concurrency)
        assert set(speech["replicas"]) == {str(r) for r in sizes.speech_replicas}
        for run in speech["replicas"].values():
            assert run["requests"] == sizes.speech_requests
            for key in ("ttft", "ttfp", "e2e"):
                check_summary(run[key])
            assert run["ttft"]["max"] <= run["e2e"]["max"]
            assert run["audio_seconds"] > 0
    else:
        assert pools["results"]["speech_skipped"].startswith("the speech extra is not installed")

    rows = pools["goals"]
    assert [row["key"] for row in rows] == [
        key
        for batch in BATCHES
        for key in (f"batch{batch}.throughput.2", f"batch{batch}.first_output.2")
    ]
    for row in rows:
        assert isinstance(row["value"], float)
        assert math.isfinite(row["value"])
        assert row["value"] > 0
        assert isinstance(row["met"], bool)
    inflation = pools["comparison"]["inflation"]
    assert set(inflation) == {str(batch) for batch in BATCHES}
    assert all(set(by_replicas) == {"1", "2"} for by_replicas in inflation.values())
    assert pools["comparison"]["vllm_omni"]["inflation"] == pytest.approx(3.11, abs=0.005)

    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(report))
    assert main(["bench", "--from", str(saved)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert out.startswith("$ omni-trio ")
    assert "Replica pools, device-time engines, batch 1" in out
    assert "Replica pools, device-time engines, batch 4" in out
    assert f"Replica goals met: {sum(row['met'] for row in rows)} of {len(rows)}" in out
    for row in rows:
        assert f"goal {row['goal']}: " in out


def test_the_cli_offers_replicas_to_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--only", "replica"]) == 2
    err = capsys.readouterr().err
    assert "'replicas'" in err  # the choices, which name it


def test_the_saved_run_prints_with_its_goals(capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(SAVED.read_text())
    assert report["command"] == "omni-trio bench --only replicas --json"
    assert report["quick"] is False
    assert main(["bench", "--from", str(SAVED)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert out.startswith("$ omni-trio bench --only replicas --json Python 3.11")
    rows = report["replicas"]["goals"]
    assert {row["key"] for row in rows} == {
        f"batch{batch}.{figure}"
        for batch in BATCHES
        for figure in ("throughput.2", "throughput.4", "first_output.8")
    }
    assert f"Replica goals met: {sum(row['met'] for row in rows)} of {len(rows)}" in out
    assert "vLLM-Omni: mean first audio 523 ms at concurrency 1, 1,629 ms at 10: 3.1x" in out
    # as docs/performance.md shows it
    assert "Replica goals met: 6 of 6" in out
    assert (
        "goal batch 1, 8 replicas: mean first output at concurrency 8 <= 1.25x at "
        "concurrency 1: 1.06 (yes)"
    ) in out
    assert "│ 8 │ 39.9 │ 7.99x │ 21.5 │ 22.2 │ 22.9 │ 72.3 │ 545 │ 3.4x │" in out


# -- the goals, judged ------------------------------------------------------------------------


def part_with(rates: dict[int, float], first_1: float, first_top: float) -> dict[str, Any]:
    """A device part: each replica count's rate at concurrency 32, and the most
    replicas' mean first output at concurrency 1 and 8 (everyone else's: 20 ms)."""

    def level(rate: float, first: float) -> dict[str, Any]:
        return {"rate": rate, "first_output": {"mean": first}}

    replicas = {}
    for count, rate in rates.items():
        firsts = {1: 0.020, 8: 0.020, 10: 0.030}
        if count == max(rates):
            firsts.update({1: first_1, 8: first_top})
        levels = {str(c): level(rate, firsts.get(c, 0.020)) for c in (1, 4, 8, 10, 32)}
        replicas[str(count)] = {"levels": levels}
    return {"concurrency": [1, 4, 8, 10, 32], "replicas": replicas}


@pytest.mark.parametrize(
    ("rates", "firsts", "unmet"),
    [
        ({1: 5.0, 2: 10.0, 4: 20.0, 8: 40.0}, (0.020, 0.022), set()),
        ({1: 5.0, 2: 9.0, 4: 17.5, 8: 40.0}, (0.020, 0.025), set()),  # at the limits
        ({1: 5.0, 2: 8.99, 4: 20.0, 8: 40.0}, (0.020, 0.020), {"throughput.2"}),
        ({1: 5.0, 2: 10.0, 4: 17.49, 8: 40.0}, (0.020, 0.020), {"throughput.4"}),
        ({1: 5.0, 2: 10.0, 4: 20.0, 8: 40.0}, (0.020, 0.02501), {"first_output.8"}),
    ],
)
def test_the_goals_are_judged_at_their_limits(
    rates: dict[int, float], firsts: tuple[float, float], unmet: set[str]
) -> None:
    results = {"device": {"1": part_with(rates, *firsts)}}
    rows = goals(results)
    assert [row["key"] for row in rows] == [
        "batch1.throughput.2",
        "batch1.throughput.4",
        "batch1.first_output.8",
    ]
    assert {row["key"] for row in rows if not row["met"]} == {f"batch1.{key}" for key in unmet}
    by_key = {row["key"]: row for row in rows}
    assert by_key["batch1.throughput.2"]["value"] == pytest.approx(rates[2] / rates[1])
    assert by_key["batch1.first_output.8"]["value"] == pytest.approx(firsts[1] / firsts[0])
    # the inflation from concurrency 1 to 10: the most replicas' 30 ms over its first
    assert comparison(results)["inflation"]["1"]["8"] == pytest.approx(0.030 / firsts[0])


def test_a_summary_has_its_mean_and_percentiles() -> None:
    assert summary([0.4, 0.1, 0.3, 0.2]) == {
        "mean": pytest.approx(0.25),
        "p50": pytest.approx(0.25),
        "p90": 0.4,
        "max": 0.4,
    }
    assert summary([float(i) for i in range(1, 11)])["p90"] == 9.0


def test_the_speech_config_sets_forward_mode_and_the_replicas() -> None:
    config = speech_config(2, {"max_tokens": 8})
    assert config.mode == "forward"
    thinker, talker, code2wav = config.stages
    assert thinker.engine_args["max_tokens"] == 8
    assert (thinker.runtime.replicas, talker.runtime.replicas, code2wav.runtime.replicas) == (
        1,
        2,
        2,
    )


# -- the device-time engines, on Trio's virtual clock -----------------------------------------


async def run_requests(
    device: Device, starts: list[float], steps: int, host: float = 0.0
) -> list[tuple[float, float]]:
    """Requests of ``steps`` steps starting at ``starts`` (seconds from now), the host
    taking ``host`` seconds over each output: each one's first output and end, from
    its start."""
    found: list[tuple[float, float]] = [(0.0, 0.0)] * len(starts)

    async def request(index: int) -> None:
        await trio.sleep(starts[index])
        began = trio.current_time()
        first = None
        outputs = device.run(steps)
        async with aclosing(outputs):
            async for _ in outputs:
                if first is None:
                    first = trio.current_time() - began
                await trio.sleep(host)
                if _["step"] == steps - 1:
                    break  # as a worker does at the engine's last output: it closes it
        assert first is not None
        found[index] = (first, trio.current_time() - began)

    async with trio.open_nursery() as nursery:
        for index in range(len(starts)):
            nursery.start_soon(request, index)
    return found


async def test_batch_1_runs_one_request_at_a_time_first_come_first_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    device = Device(step_seconds=0.020, batch=1)
    found = await run_requests(device, [0.0, 0.001, 0.002], steps=3)
    assert found == [
        pytest.approx((0.020, 0.060)),
        pytest.approx((0.079, 0.119)),  # its slot frees at 60 ms
        pytest.approx((0.138, 0.178)),
    ]


async def test_batch_4_shares_steps_and_a_newcomer_joins_the_next_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    device = Device(step_seconds=0.020, batch=4)
    # 0 ms: the first step starts; 5 and 10 ms: they join the second (20-40 ms), which
    # the first request is in too; the fifth waits for a slot (the first's, at 60 ms).
    found = await run_requests(device, [0.0, 0.005, 0.010, 0.010, 0.011], steps=3)
    assert found == [
        pytest.approx((0.020, 0.060)),
        pytest.approx((0.035, 0.075)),
        pytest.approx((0.030, 0.070)),
        pytest.approx((0.030, 0.070)),
        pytest.approx((0.069, 0.109)),
    ]


async def test_a_request_that_waited_takes_over_its_slot_at_the_step_it_was_freed_at(
    autojump_clock: trio.testing.MockClock,
) -> None:
    device = Device(step_seconds=0.020, batch=2)
    # The first two share steps from 20 ms; the third waits for a slot. The host takes
    # 1 ms over each output, so the first lets go of its slot at 61 ms, after the
    # second went on with the step from 60 ms: the third joins that step, as a
    # scheduler fills a freed slot at the boundary, and does not wait for the next.
    found = await run_requests(device, [0.0, 0.010, 0.011], steps=3, host=0.001)
    assert found == [
        pytest.approx((0.020, 0.061)),
        pytest.approx((0.030, 0.071)),
        pytest.approx((0.069, 0.110)),
    ]
