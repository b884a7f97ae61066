"""The benchmark: its checks of what it measures, and ``python -m omni_trio.bench``
without the bench extra (one line, status 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import omni_trio
from frameworks import FRAMEWORKS
from omni_trio.bench import _latency
from omni_trio.bench._workloads import BenchError, BenchStage, throughput
from omni_trio.compare.frameworks import Framework

# Runs the module as ``python -m`` would, with the package made unimportable the way
# an environment without it is: ``import pyinstrument`` raises ModuleNotFoundError.
RUN_WITHOUT = """
import runpy, sys
sys.modules[sys.argv[1]] = None
sys.argv = ["python -m omni_trio.bench", *sys.argv[2:]]
runpy.run_module("omni_trio.bench", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    ("missing", "args", "needed_by"),
    [
        ("pyinstrument", ["--impl", "trio", "--profile"], "--profile"),
        ("uvloop", ["--impl", "asyncio+uvloop", "--quick"], "--impl asyncio+uvloop"),
    ],
)
def test_a_missing_bench_dependency_says_what_to_install(
    missing: str, args: list[str], needed_by: str
) -> None:
    env = dict(os.environ)
    src = str(Path(omni_trio.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT, missing, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"python -m omni_trio.bench: {needed_by} needs {missing}, which is not installed: "
        "pip install 'omni-trio[bench]' (from a checkout: pip install '.[bench]')"
    ]


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=lambda fw: fw.name)
@pytest.mark.parametrize(
    ("streams", "batches"),
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["next_output", "next_outputs", "async-for", "receive_batch"],
)
def test_throughput_checks_that_every_request_got_all_its_outputs(
    fw: Framework, streams: bool, batches: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if batches and not fw.batches:
        pytest.skip("the plain design has no batches")

    def run() -> float:
        return float(
            fw.run(
                lambda: throughput(fw, 4, 10, streams=streams, mode="async_chunk", batches=batches)
            )
        )

    assert run() > 0  # the real thing passes the check
    prepare = BenchStage.prepare

    def losing_one(self: BenchStage, request_ids: list[str]) -> None:
        prepare(self, request_ids)
        del self.prepared["r2"][3]  # stages 0 and 2 are final: r2 gets 18 of its 20

    monkeypatch.setattr(BenchStage, "prepare", losing_one)
    with pytest.raises(BenchError, match=rf"^{fw.name}: request 'r2' got 18 outputs, 20 expected"):
        run()


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=lambda fw: fw.name)
def test_a_latency_run_reports_its_backlog_and_the_machine(fw: Framework) -> None:
    result = _latency.latency(fw, 20_000, 0.05)
    assert result["rate"] == 20_000
    assert 0 < result["p50"] <= result["p99"] <= result["max"]
    assert result["lag"] <= result["max"]
    assert result["drained"] is (result["lag"] <= _latency.DRAIN_BOUND)
    assert result["foreign"] is None or 0 <= result["foreign"] <= 1


@pytest.mark.parametrize("guess", [1_000.0, 100_000.0, 10_000_000.0])
def test_capacity_brackets_the_highest_rate_that_drains(
    guess: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 123_456.0
    probes: list[float] = []

    def fake(fw: Framework, rate: float, duration: float) -> dict[str, object]:
        probes.append(rate)
        return {"drained": rate <= limit}

    monkeypatch.setattr(_latency, "latency", fake)
    found = _latency.capacity(FRAMEWORKS[0], guess, steps=8)
    assert found <= limit  # it drained there: never above what drains
    assert found >= limit * 0.98  # 8 bisections of the bracket
    assert len(probes) < 30


def test_capacity_gives_up_when_nothing_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_latency, "latency", lambda fw, rate, duration: {"drained": False})
    with pytest.raises(BenchError, match="drains at no rate above 1,000/s"):
        _latency.capacity(FRAMEWORKS[0], 50_000.0)


def test_foreign_load_without_proc_stat_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_latency, "_STAT", Path("/nonexistent/stat"))
    with _latency.ForeignLoad() as load:
        pass
    assert load.value is None
