"""``tools/bench_serve.py`` at a tiny size: it runs to its end and its JSON has its fields.

No timing is asserted: the numbers belong in docs/results/serving.md, not in tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import omni_trio

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "bench_serve.py"

pytest.importorskip("hypercorn")
pytest.importorskip("starlette")


def test_the_serving_benchmark_runs_small(tmp_path: Path) -> None:
    env = dict(os.environ)
    src = str(Path(omni_trio.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    out = tmp_path / "serving.json"
    args = ["--levels=3", "--hold=3", "--max-tokens=5", "--tokens-per-second=100"]
    result = subprocess.run(
        [sys.executable, str(TOOL), *args, f"--json={out}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["pacing"]["max_tokens"] == 5
    (level,) = report["levels"]
    assert level["streams"] == 3
    inproc, server = level["inprocess"], level["server"]
    assert inproc["errors"] == []
    assert server["errors"] == []
    # 6 requests (2 per client) of 5 text chunks and 1 audio chunk each
    assert server["requests"] == inproc["requests"] == 6
    assert server["text_chunks"] == 30
    assert server["audio_chunks"] == 6
    assert server["traced_chunks"] == 36
    for name in ("added", "stage_to_response", "stage_to_socket", "stage_to_client"):
        assert set(server[name]) >= {"p50", "p99", "max", "mean"}
        assert server[name]["n"] == 36
    assert inproc["stage_to_consumer"]["n"] == 36
    assert server["cpu_per_chunk"] >= 0
    memory = report["memory"]
    assert memory["held_streams"] == 3
    assert memory["rss_held"] > 0
    assert "per_stream" in memory
