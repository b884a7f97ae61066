"""``omni_trio.open_pipeline``: a config, a path or a shipped name, its overrides, what
the running pipeline shows, and its errors, each as itself."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pytest
import trio

from omni_trio import Pipeline, PipelineStatistics, open_pipeline
from omni_trio.config import ConfigError, resolve_pipeline, shipped_pipeline
from omni_trio.process import ProcessStage, ShmConnector, WorkerStartError
from omni_trio.process.worker import _shm
from processes import pipeline_config, worker_processes

DEMO = Path(str(files("omni_trio") / "pipelines" / "demo.toml"))
TWO = [("stream", "{ count = 2 }", True, ""), ("relay", "{}", True, "")]


async def test_a_shipped_pipeline_by_name_with_overrides():
    async with open_pipeline("demo", max_in_flight=3, stage_idle_timeout=30.0) as pipeline:
        assert isinstance(pipeline, Pipeline)
        assert pipeline.config.pipeline.name == "simulated-qwen-omni"
        assert pipeline.config.pipeline.max_in_flight == 3
        assert pipeline.orchestrator.max_in_flight == 3
        assert [s.name for s in pipeline.stages] == ["thinker", "talker", "code2wav"]
        assert all(isinstance(s, ProcessStage) for s in pipeline.stages)
        assert isinstance(pipeline.connector, ShmConnector)
        assert repr(pipeline) == (
            "<Pipeline 'simulated-qwen-omni' (thinker -> talker -> code2wav, async_chunk)>"
        )
        assert {s.pid for s in pipeline.stages} <= set(worker_processes())
        async with pipeline.orchestrator.open_request("Hello") as stream:
            audio = [o.data async for o in stream if o.stage_id == 2 and o.data]
        assert stream.terminal.finish_reason == "completed"
        assert audio
        stats = pipeline.statistics()
        assert isinstance(stats, PipelineStatistics)
        assert stats.orchestrator.completed == 1
        assert [s.workers_started for s in stats.stages] == [1, 1, 1]
        assert stats.connector is not None
        assert stats.connector.workers_attached == 3
        prefix = pipeline.prefix
    assert worker_processes() == []
    assert _shm.listing(prefix) == []


async def test_a_config_as_it_is_in_forward_mode():
    config = pipeline_config(*TWO, async_chunk=False)
    async with open_pipeline(config) as pipeline:
        assert pipeline.config is config
        assert pipeline.connector is None
        assert pipeline.statistics().connector is None
        async with pipeline.orchestrator.open_request("x") as stream:
            data = [o.data async for o in stream if o.data is not None]
    assert data == ["x:0:0", "x:0:1", "X:0:0", "X:0:1"]


@pytest.mark.parametrize("as_path", [str, Path])
def test_a_path_string_or_pathlike_names_a_file(as_path):
    assert resolve_pipeline(as_path(DEMO)) == shipped_pipeline("demo")


def test_a_file_named_as_a_shipped_pipeline_wins(tmp_path, monkeypatch):
    (tmp_path / "demo").write_text(DEMO.read_text().replace("simulated-qwen-omni", "mine"))
    monkeypatch.chdir(tmp_path)
    assert resolve_pipeline("demo").pipeline.name == "mine"


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        ("dmeo", ConfigError, r"^dmeo: cannot read it: .*no pipeline of that name ships"),
        ("missing.toml", ConfigError, r"^missing\.toml: cannot read it"),
        (42, TypeError, "a pipeline is a PipelineConfig, a path or a shipped pipeline's name"),
    ],
)
async def test_what_names_no_pipeline_is_a_clear_error(source, error, message):
    with pytest.raises(error, match=message):
        async with open_pipeline(source):
            pytest.fail("must not start")  # pragma: no cover
    assert worker_processes() == []


async def test_a_bad_override_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"pipeline\.max_in_flight: Expected `int` >= 1"):
        async with open_pipeline("demo", max_in_flight=0):
            pytest.fail("must not start")  # pragma: no cover
    with pytest.raises(ConfigError, match="unknown field `max_in_fligth`"):
        async with open_pipeline("demo", max_in_fligth=4):
            pytest.fail("must not start")  # pragma: no cover
    assert worker_processes() == []


async def test_a_stage_that_cannot_start_is_its_own_error():
    broken = pipeline_config(TWO[0], ("broken_factory", "{}", True, ""))
    with trio.fail_after(10), pytest.raises(WorkerStartError, match="no weights found"):
        async with open_pipeline(broken):
            pytest.fail("must not start")  # pragma: no cover
    assert worker_processes() == []
