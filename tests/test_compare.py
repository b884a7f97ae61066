"""Every cancellation scenario behaves as docs/cancellation.md says, on this Python."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from omni_trio.compare.scenarios import EXPECTED, SCENARIOS, expected_verdicts, run_scenario

DOC = Path(__file__).resolve().parent.parent / "docs" / "cancellation.md"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.key)
def test_observed_outcome_is_the_documented_one(scenario):
    on_asyncio, on_trio = run_scenario(scenario)
    expected = expected_verdicts(scenario.key)
    assert (on_asyncio.verdict, on_trio.verdict) == expected, (
        f"Python {sys.version_info[:2]}: asyncio {on_asyncio}, trio {on_trio}"
    )


def test_every_scenario_is_expected_and_documented():
    keys = [s.key for s in SCENARIOS]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(EXPECTED)
    doc = DOC.read_text()
    for key in keys:
        assert f"`{key}`" in doc, f"docs/cancellation.md does not explain {key}"
