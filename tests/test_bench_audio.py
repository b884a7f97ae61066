"""``omni-trio bench --only audio``: the audio scenarios run, and judge their goals.

A quick run in the voice session (``nox -s voice``: the transcription needs Whisper);
without the ``llm`` extra, the busy thinker is the speech pipeline's simulated one.
"""

from __future__ import annotations

import json

from voice_helpers import need_voice

need_voice()

from omni_trio.bench._audio import GOALS  # noqa: E402
from omni_trio.cli import main  # noqa: E402


def test_the_audio_bench_runs_and_judges_its_goals(capsys):
    assert main(["bench", "--only", "audio", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    audio = report["audio"]
    assert [g["key"] for g in audio["goals"]] == list(GOALS)
    speech = audio["results"]["speech"]
    assert speech["input_chars"] == 200
    assert speech["idle"]["first_byte"]["n"] == 3
    assert speech["c8"]["first_byte"]["n"] == 8
    assert 8 < speech["idle"]["audio_seconds"] < 20  # 200 characters, said
    heard = audio["results"]["transcription"]
    assert 9 < heard["audio_seconds"] < 12
    assert "umbrella" in heard["text"].lower()
