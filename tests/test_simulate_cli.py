"""``omni-trio simulate``'s output: the log lines its injected faults cause are
expected, so hidden unless ``--verbose``; its counts are said in good English."""

from __future__ import annotations

import logging

import pytest
import trio

from omni_trio.cli import main
from omni_trio.cli._common import plural
from omni_trio.config import parse_pipeline
from omni_trio.testing import Fault, open_simulated_pipeline

#: A seed whose faults kill a worker (its log: "stage 0 replica 1: its worker died").
KILLING_SEED = "0"


def died(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "its worker died" in r.getMessage()]


def test_the_injected_faults_logs_are_hidden_by_default(caplog, capsys):
    assert main(["simulate", "--seed", KILLING_SEED]) == 0
    assert died(caplog) == []
    assert capsys.readouterr().err == ""
    # the logger is as it was: the hiding lasts the command only
    assert logging.getLogger("omni_trio").level == logging.NOTSET


@pytest.mark.parametrize("flag", ["-v", "--verbose"])
def test_verbose_shows_them(flag, caplog, capsys):
    assert main(["simulate", "--seed", KILLING_SEED, flag]) == 0
    assert died(caplog), "the seed's faults kill no worker any more: pick another seed"
    assert logging.getLogger("omni_trio").level == logging.NOTSET
    assert "seed 0: 50 requests (" in capsys.readouterr().out


def test_an_error_is_never_hidden(caplog):
    """Only the level of an injected fault's lines is hidden: an error shows."""
    from omni_trio.cli.simulate import _fault_logs

    with _fault_logs(verbose=False):
        logging.getLogger("omni_trio.process").warning("a worker died")
        logging.getLogger("omni_trio").error("something no fault explains")
    assert [r.getMessage() for r in caplog.records] == ["something no fault explains"]


def test_one_run_is_said_in_the_singular(capsys):
    assert main(["simulate", "--runs", "1", "--start", "5", "--processes", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 run, seed 5: 1 passed every invariant, ")
    assert "1 runs" not in out


def test_plural():
    assert [plural(n, "request") for n in (0, 1, 2)] == ["0 requests", "1 request", "2 requests"]


CONFIG = """
[pipeline]
name = "one lost"
async_chunk = true
shutdown_grace = 1.0
[[stages]]
stage_id = 0
engine = "omni_trio.testing._sim_engines:source"
engine_args = { count = 5, delay = 0.1 }
final_output = true
[stages.runtime]
restart = true
"""


@pytest.mark.parametrize(("requests", "said"), [(1, "1 request"), (2, "2 requests")])
async def test_a_dead_worker_says_how_many_requests_it_lost(requests, said, autojump_clock, caplog):
    """``stage 0: its worker died: ... (1 request lost with it)``, not ``1 requests``."""
    plan = [Fault(at=0.25, kind="kill", stage=0)]
    async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0, faults=plan) as sim:

        async def one(prompt: str) -> None:
            async with sim.open_request(prompt) as stream:
                async for _ in stream:
                    pass

        async with trio.open_nursery() as nursery:
            for index in range(requests):
                nursery.start_soon(one, f"p{index}")
    [line] = died(caplog)
    assert line.endswith(f"({said} lost with it)")
