"""``tools/bench_serve.py`` at a tiny size: it runs to its end and its JSON has its fields;
and its floor (``tools/_serve_floor.py``) sends what the server sends.

No timing is asserted: the numbers belong in docs/results/serving.md, not in tests.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

import omni_trio
from omni_trio import OrchOutput

pytest.importorskip("hypercorn")
pytest.importorskip("starlette")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import _serve_floor as floor
import bench_serve

from helpers import ONLY_FULL_SIZE
from omni_trio.serve import FinalOutput
from omni_trio.serve._answer import Answer, Plan
from omni_trio.serve._chat import SSE_HEADERS

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "bench_serve.py"
MODEL = "simulated-qwen-omni"
TEXT, AUDIO = FinalOutput(0, "text", "thinker"), FinalOutput(2, "audio", "code2wav")


@ONLY_FULL_SIZE
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
    for where in (server, level["floor"], level["replay"]):
        assert set(where["gc"]) == {"collections", "full", "max_pause", "total_pause"}
        assert set(where["writes_in_flight"]) == {"p50", "p90", "p99", "max"}
    for bare in (level["floor"], level["replay"]):  # bare Hypercorn, the same streams
        assert bare["errors"] == []
        assert (bare["requests"], bare["text_chunks"], bare["audio_chunks"]) == (6, 30, 6)
        assert bare["traced_chunks"] == bare["added"]["n"] == 36
        assert set(bare["added"]) >= {"p50", "p99", "max", "mean"}
    goal = report["goal"]
    assert goal["streams"] == 3
    assert goal["added_p99"] == server["added"]["p99"]
    assert goal["floor_p99"] == level["floor"]["added"]["p99"]
    assert goal["replay_p99"] == level["replay"]["added"]["p99"]
    assert isinstance(goal["met"], bool)
    assert isinstance(goal["met_against_replay"], bool)
    memory = report["memory"]
    assert memory["held_streams"] == 3
    assert memory["rss_held"] > 0
    assert "per_stream" in memory


def test_the_floor_streams_the_servers_bytes():
    """The floor's events are the server's (``Answer``'s) for the same outputs, byte
    for byte but for the ids and ``created``; its headers are the server's too."""
    pacing = bench_serve.Pacing(1000.0, 5, chunk_codes=7)  # 3 audio chunks, the last short
    assert "".join(kinds for _, kinds in floor.schedule(pacing)).count("a") == 3
    app = floor.FloorApp(pacing, MODEL)
    request = json.dumps({"messages": [{"role": "user", "content": "a prompt"}]}).encode()
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": request, "more_body": False}

    async def send(message):
        sent.append(message)

    trio.run(app, {"type": "http", "path": "/v1/chat/completions"}, receive, send)
    start, *bodies = sent
    assert start["headers"] == SSE_HEADERS
    assert [b["more_body"] for b in bodies] == [True] * 8 + [False]
    answer = Answer(Plan("a prompt", (TEXT, AUDIO), True, False, "pcm16", None), MODEL)
    expected, sizes = [], []
    for body in bodies[:-1]:
        (delta,) = (c["delta"] for c in json.loads(body["body"][6:])["choices"])
        if "content" in delta:  # the floor's stamp in it; the server's stamp is the stage's
            output = OrchOutput("r", 0, delta["content"], False, None)
        else:
            pcm = base64.b64decode(delta["audio"]["data"])
            sizes.append(len(pcm) // floor.PCM_PER_CODE)  # codes: code2wav's 1920 B each
            output = OrchOutput("r", 2, pcm, False, None)
        expected.append(answer.take([output]))
    answer.take([OrchOutput("r", 2, None, True, "completed")])
    expected.append(answer.closing())
    assert [_normalized(b["body"]) for b in bodies] == [_normalized(e) for e in expected]
    assert sizes == [7, 7, 6]  # 20 codes, 7 to a chunk


def _normalized(events: bytes) -> bytes:
    """``events`` with every chunk's id, audio id and ``created`` made constant."""
    events = re.sub(rb'"chatcmpl-[0-9a-f]{32}"', b'"chatcmpl-ID"', events)
    events = re.sub(rb'"audio-[0-9a-f]{32}"', b'"audio-ID"', events)
    return re.sub(rb'"created":[0-9]+,', b'"created":0,', events)


def test_the_floor_replays_the_writes_it_is_given():
    """A stream whose key has writes set writes those chunks, each write at its time
    (from the start given, monotonic ns); another stream is paced."""
    pacing = bench_serve.Pacing(1000.0, 3, chunk_codes=7)
    app = floor.FloorApp(pacing, MODEL)
    start = time.monotonic_ns()
    plan = {"start": start, "streams": {"7": [[20_000_000, "t"], [40_000_000, "ta"]]}}

    async def call(path, body, headers=()):
        sent, arrived = [], []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)
            arrived.append(time.monotonic_ns() - start)

        scope = {"type": "http", "path": path, "headers": list(headers)}
        await app(scope, receive, send)
        return sent, arrived

    async def main():
        await call("/_bench/replay", json.dumps(plan).encode())
        request = json.dumps({"messages": [{"content": "p"}]}).encode()
        replayed = await call("/v1/chat/completions", request, [(b"x-bench-stream", b"7")])
        paced = await call("/v1/chat/completions", request, [(b"x-bench-stream", b"8")])
        return replayed, paced

    (sent, arrived), (paced, _) = trio.run(main)
    _, *bodies, closing = sent
    assert [b["body"].count(b"data: ") for b in bodies] == [1, 2]
    assert b'"audio"' in bodies[1]["body"]
    assert arrived[1] >= 20_000_000
    assert arrived[2] >= 40_000_000
    assert closing["more_body"] is False
    assert len(paced) == 1 + 3 + 2 + 1  # headers, 3 text, 2 audio (12 codes), the closing
