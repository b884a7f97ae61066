"""``omni-trio bench --only ray``: the Ray scenarios run, and judge their goals.

A module of its own, after tests/test_ray.py: the bench starts its own local
cluster, and one Ray connection per process is the rule, so the tests' cluster must
be gone by then. Runs where Ray is installed (``nox -s ray``).
"""

from __future__ import annotations

import json
import os

import pytest

from omni_trio.cli import main

if not os.environ.get("OMNI_TRIO_REQUIRE_RAY"):
    pytest.importorskip("ray")


def test_the_ray_bench_runs_and_judges_its_goals(capsys):
    """Keeps the Ray scenarios from rotting; at --quick their numbers mean little,
    but the node-death goal holds at any size."""
    assert main(["bench", "--only", "ray", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ray = report["ray"]
    assert "process" not in report
    assert [g["key"] for g in ray["goals"]] == ["ray.hop_p50", "ray.rate", "ray.node_death"]
    (trial,) = ray["results"]["node_death"]["trials"]
    assert trial["finish_reason"] == "error"
    assert trial["names_node"], trial["error"]
    assert trial["seconds"] <= 5.0
    sizes = ray["results"]["chunks"]["sizes"]
    assert set(sizes) == {"64", "4096", "49152"}
    assert all(set(sides) == {"ray", "process"} for sides in sizes.values())
