"""Pipeline configs: what loads, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from omni_trio import OrchestratorOptions
from omni_trio.config import ConfigError, PipelineSection, load_pipeline, parse_pipeline
from omni_trio.demo.runner import template
from omni_trio.process._options import WINDOW, WINDOW_BYTES

GOOD = """
[pipeline]
name = "tiny"
async_chunk = true

[[stages]]
stage_id = 0
engine = "pkg.mod:make"
final_output = true

[[stages]]
stage_id = 1
engine = "pkg.mod:make"
engine_input_source = [0]
prewarm_func = "pkg.mod:warm"
final_output = true
final_output_type = "audio"
[stages.runtime]
restart = true
heartbeat_timeout = 3.0
"""


def test_a_good_config():
    config = parse_pipeline(GOOD)
    assert config.final_stage_ids == {0, 1}
    assert config.mode == "async_chunk"
    assert config.stages[1].runtime.restart
    assert config.stages[1].final_output_type == "audio"
    assert config.stages[0].label == "stage0"
    assert config.with_mode(async_chunk=False).pipeline.connector == "none"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", r"stages\[1\]\.sample_rate: must be a positive integer \(Hz\), got 0"),
        ("-8000", r"stages\[1\]\.sample_rate: must be a positive integer \(Hz\), got -8000"),
        ('"24k"', r"stages\[1\]\.sample_rate: Expected `int`, got `str`"),
    ],
)
def test_an_audio_stage_says_its_sample_rate(value, message):
    assert parse_pipeline(GOOD).stages[1].sample_rate == 24_000  # the default
    audio = 'final_output_type = "audio"'
    config = parse_pipeline(GOOD.replace(audio, f"{audio}\nsample_rate = 16000"))
    assert config.stages[1].sample_rate == 16_000
    with pytest.raises(ConfigError, match=message):
        parse_pipeline(GOOD.replace(audio, f"{audio}\nsample_rate = {value}"), source="p.toml")


def test_the_demo_pipeline_loads_and_builds_its_functions():
    config = template()
    assert [s.label for s in config.stages] == ["thinker", "talker", "code2wav"]
    assert config.stage_names == {0: "thinker", 1: "talker", 2: "code2wav"}
    assert config.stage_chain == "thinker -> talker -> code2wav"
    assert config.final_output_types == {0: "text", 2: "audio"}  # the talker is not final
    assert set(config.orchestrator_functions()) == {"graph", "prewarm_fn"}
    forward = config.with_mode(async_chunk=False).orchestrator_functions()["input_fn"]
    assert forward(1, {0: ["a ", "b "]}) == ["a ", "b "]  # the talker's: none, as is
    assert forward(2, {1: [[1, 2], [3]]}) == [1, 2, 3]  # code2wav's custom function


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("final_output = true", 'final_output = "yes"'),
            r"stages\[0\]\.final_output: Expected `bool`",
        ),
        (
            ("restart = true", "restart = true\nrestrat = 1"),
            r"stages\[1\]\.runtime: .*unknown field `restrat`",
        ),
        (
            ('engine = "pkg.mod:make"', 'engine = "make"'),
            r"stages\[0\]\.engine: 'make' is not an import path",
        ),
        (("stage_id = 1", "stage_id = 2"), r"stages\[1\]\.stage_id: .*expected 1, got 2"),
        (
            ("engine_input_source = [0]", "engine_input_source = [1]"),
            r"stages\[1\]\.engine_input_source: stage 1 cannot read itself",
        ),
        (
            ("engine_input_source = [0]", "engine_input_source = [2]"),
            r"stages\[1\]\.engine_input_source: there is no stage 2 \(stages 0\.\.1\)",
        ),
        (
            ("engine_input_source = [0]", "engine_input_source = [0, 0]"),
            r"stages\[1\]\.engine_input_source: names a stage twice: \[0, 0\]",
        ),
        (
            ('final_output_type = "audio"', 'final_output_type = "video"'),
            r"stages\[1\]\.final_output_type",
        ),
        (
            ("heartbeat_timeout = 3.0", "heartbeat_timeout = 0"),
            r"stages\[1\]\.runtime: heartbeat_timeout must be a positive number of seconds",
        ),
        (
            ("async_chunk = true", "async_chunk = false"),
            r"stages\[1\]\.prewarm_func: .*async_chunk",
        ),
        (('name = "tiny"', 'name = "tiny"\nconnector = "zmq"'), r"pipeline\.connector"),
        (
            ("async_chunk = true", 'async_chunk = true\nconnector = "none"'),
            r"pipeline\.connector: ",
        ),
        (
            ('engine = "pkg.mod:make"', 'engine = "pkg.mod:make"\nprewarm_func = "pkg.mod:w"'),
            r"stages\[0\]\.prewarm_func: only stages that read another stage",
        ),
        (
            (
                'engine = "pkg.mod:make"',
                'engine = "pkg.mod:make"\ncustom_process_input_func = "a:b"',
            ),
            r"stages\[0\]\.custom_process_input_func: stage 0's input is the prompt",
        ),
        (
            ("heartbeat_timeout = 3.0", "completion_delay = -1.0"),
            r"stages\[1\]\.runtime: completion_delay must be a number of seconds >= 0",
        ),
        (
            ('name = "tiny"', 'name = "tiny"\nstage_idle_timeout = 0'),
            r"^p\.toml: pipeline\.stage_idle_timeout: Expected `float` > 0",
        ),
        (
            ('name = "tiny"', 'name = "tiny"\nstage_idle_timeout = "2s"'),
            r"pipeline\.stage_idle_timeout: Expected `float \| null`, got `str`",
        ),
        (
            ('name = "tiny"', 'name = "tiny"\nmax_in_flight = 0'),
            r"pipeline\.max_in_flight: Expected `int` >= 1",
        ),
        (
            ('name = "tiny"', 'name = "tiny"\nmax_in_flight = 2.5'),
            r"pipeline\.max_in_flight: Expected `int \| null`, got `float`",
        ),
        (
            ('name = "tiny"', 'name = "tiny"\nshutdown_grace = -1.0'),
            r"pipeline\.shutdown_grace: Expected `float` >= 0",
        ),
        (
            ('name = "tiny"', 'name = "tiny"\nshutdown_grace = nan'),
            r"pipeline\.shutdown_grace: Expected `float` >= 0",
        ),
        (
            ('name = "tiny"', 'name = "tiny"\ninline_chunk_bytes = -1'),
            r"pipeline\.inline_chunk_bytes: Expected `int` >= 0",
        ),
        (
            ('name = "tiny"', 'name = "tiny"\ninline_chunk_bytes = 16777217'),
            r"pipeline\.inline_chunk_bytes: Expected `int` <= 16777216",
        ),
        (('name = "tiny"', 'name = "tiny"\nwindow = 0'), r"pipeline\.window: Expected `int` >= 1"),
        (
            ('name = "tiny"', 'name = "tiny"\nwindow = 65537'),
            r"pipeline\.window: Expected `int` <= 65536",
        ),
        (
            ('name = "tiny"', 'name = "tiny"\nwindow_bytes = 0'),
            r"pipeline\.window_bytes: Expected `int` >= 1",
        ),
        (("[[stages]]", "[[stage]]"), r"unknown field `stage`"),
        (("[pipeline]", "[pipeline"), "not valid TOML"),
    ],
)
def test_errors_name_the_key(change, message):
    old, new = change
    with pytest.raises(ConfigError, match=message):
        parse_pipeline(GOOD.replace(old, new, 1), source="p.toml")


def test_orchestrator_options_in_the_pipeline_table():
    """[pipeline] stage_idle_timeout, max_in_flight, shutdown_grace and the flow
    bounds reach open_orchestrator's arguments; absent, they are its defaults."""
    defaults = parse_pipeline(GOOD).orchestrator_options
    assert defaults == {
        "stage_idle_timeout": None,
        "max_in_flight": None,
        "priority_aging_s": 1.0,
        "shutdown_grace": 5.0,
        "max_unread_bytes": 4 * 1024 * 1024,
        "max_unread_outputs": 1024,
        "consumer_idle_timeout": 60.0,
        "max_forward_bytes": 256 * 1024 * 1024,
    }
    fields = attrs.fields_dict(OrchestratorOptions)  # open_orchestrator's keywords
    assert all(fields[name].default == value for name, value in defaults.items())
    text = GOOD.replace(
        'name = "tiny"',
        'name = "tiny"\nstage_idle_timeout = 2\nmax_in_flight = 4\nshutdown_grace = 0\n'
        "priority_aging_s = 0.5\nmax_unread_bytes = 1000\nmax_unread_outputs = 10\n"
        "consumer_idle_timeout = 0\n"
        "max_forward_bytes = 5000",
    )
    options = parse_pipeline(text).orchestrator_options
    assert options == {
        "stage_idle_timeout": 2.0,
        "max_in_flight": 4,
        "priority_aging_s": 0.5,
        "shutdown_grace": 0.0,
        "max_unread_bytes": 1000,
        "max_unread_outputs": 10,
        "consumer_idle_timeout": 0.0,
        "max_forward_bytes": 5000,
    }
    assert type(options["stage_idle_timeout"]) is float


def test_the_serve_table_sets_each_endpoints_default_priority():
    config = parse_pipeline(GOOD + "\n[serve.priority]\nchat = 5\nrealtime = -20\n")
    assert config.serve.priority.as_dict() == {
        "chat": 5,
        "speech": 0,
        "transcription": 0,
        "realtime": -20,
    }
    assert parse_pipeline(GOOD).serve.priority.realtime == -10
    with pytest.raises(ConfigError, match=r"serve\.priority\.chat: Expected `int` <= 1000"):
        parse_pipeline(GOOD + "\n[serve.priority]\nchat = 5000\n")
    with pytest.raises(ConfigError, match=r"serve\.priority.*unknown field `batch`"):
        parse_pipeline(GOOD + "\n[serve.priority]\nbatch = 1\n")


def test_with_pipeline_overrides_and_checks_like_a_loaded_config():
    config = parse_pipeline(GOOD)
    changed = config.with_pipeline(stage_idle_timeout=1.5, max_in_flight=2)
    assert changed.pipeline.stage_idle_timeout == 1.5
    assert changed.pipeline.max_in_flight == 2
    assert changed.pipeline.name == "tiny"
    assert changed.stages == config.stages
    assert config.pipeline.stage_idle_timeout is None  # the original is untouched
    assert changed.with_pipeline(stage_idle_timeout=None).pipeline.stage_idle_timeout is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"stage_idle_timeout": 0}, r"^pipeline\.stage_idle_timeout: Expected `float` > 0"),
        ({"stage_idle_timeout": -2.0}, r"^pipeline\.stage_idle_timeout: Expected `float` > 0"),
        ({"max_in_flight": 0}, r"^pipeline\.max_in_flight: Expected `int` >= 1"),
        ({"max_in_flight": True}, r"^pipeline\.max_in_flight: Expected `int \| null`, got `bool`"),
        ({"shutdown_grace": -0.5}, r"^pipeline\.shutdown_grace: Expected `float` >= 0"),
        ({"shutdown_grace": None}, r"^pipeline\.shutdown_grace: Expected `float`, got `null`"),
        ({"stage_idle_timeut": 1.0}, r"^pipeline: .*unknown field `stage_idle_timeut`"),
        ({"async_chunk": False}, r"^stages\[1\]\.prewarm_func: .*async_chunk"),
    ],
)
def test_with_pipeline_refuses_bad_values_naming_the_key(changes, message):
    with pytest.raises(ConfigError, match=message):
        parse_pipeline(GOOD).with_pipeline(**changes)


def test_no_final_stage():
    with pytest.raises(ConfigError, match="stages: no stage has final_output = true"):
        parse_pipeline(GOOD.replace("final_output = true", "final_output = false"))


def test_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        load_pipeline(tmp_path / "nope.toml")


def test_no_stages():
    with pytest.raises(ConfigError, match="stages: a pipeline needs at least one stage"):
        parse_pipeline("stages = []")


def test_a_function_that_cannot_be_imported_is_named_by_its_key():
    config = parse_pipeline(GOOD.replace("pkg.mod:warm", "no_such_module_here:warm"))
    with pytest.raises(
        ConfigError,
        match=r"stages\[1\]\.prewarm_func: cannot import 'no_such_module_here:warm': "
        "ModuleNotFoundError",
    ):
        config.orchestrator_functions()


def test_the_shm_connector_needs_async_chunk():
    text = GOOD.replace('prewarm_func = "pkg.mod:warm"\n', "")
    text = text.replace("async_chunk = true", 'async_chunk = false\nconnector = "shm"')
    with pytest.raises(ConfigError, match=r"pipeline\.connector: the shm connector carries"):
        parse_pipeline(text)
    forward = parse_pipeline(text.replace('"shm"', '"none"'))
    assert forward.mode == "forward"


def test_worker_options_are_checked_where_they_are_made():
    """The same object is [stages.runtime] and open_process_stage(options=...)."""
    from omni_trio.process import WorkerOptions

    assert WorkerOptions().heartbeat_timeout == 10.0
    with pytest.raises(ValueError, match="heartbeat_timeout must be a positive number of sec"):
        WorkerOptions(heartbeat_timeout=0)
    with pytest.raises(ValueError, match="shutdown_grace must be a number of seconds >= 0"):
        WorkerOptions(shutdown_grace=float("nan"))
    with pytest.raises(TypeError, match="'restart' must be <class 'bool'>"):
        WorkerOptions(restart="yes")


async def test_open_process_stage_wants_worker_options():
    from omni_trio.process import open_process_stage

    with pytest.raises(TypeError, match="options must be a WorkerOptions, got"):
        async with open_process_stage("process_engines:stream", options={"restart": True}):
            pytest.fail("must not start")  # pragma: no cover


def test_the_windows_default_to_the_connectors():
    """``[pipeline] window`` and ``window_bytes`` (tests/test_connector.py sees them
    reach the workers)."""
    section = parse_pipeline(GOOD).pipeline
    assert (section.window, section.window_bytes) == (WINDOW, WINDOW_BYTES) == (64, 1 << 20)
    text = GOOD.replace('name = "tiny"', 'name = "tiny"\nwindow = 8\nwindow_bytes = 4096')
    section = parse_pipeline(text).pipeline
    assert (section.window, section.window_bytes) == (8, 4096)


def test_inline_chunk_bytes_reaches_the_connector_and_defaults_to_64_kib():
    assert parse_pipeline(GOOD).pipeline.inline_chunk_bytes == 65536
    text = GOOD.replace('name = "tiny"', 'name = "tiny"\ninline_chunk_bytes = 0')
    assert parse_pipeline(text).pipeline.inline_chunk_bytes == 0


def test_the_reference_configs_sample_is_a_valid_config():
    """docs/config.md's sample names every [pipeline] key: it parses, as written."""
    text = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    sample = text.split("```toml\n", 1)[1].split("```", 1)[0]
    config = parse_pipeline(sample, source="docs/config.md")
    written = {line.split("=")[0].strip() for line in sample.split("[[stages]]")[0].splitlines()}
    assert set(PipelineSection.__struct_fields__) - written <= {"ray_address"}
    assert config.pipeline.max_unread_bytes == 4 * 1024 * 1024


#: listen feeds the thinker and a prosody stage; the thinker reads both (a join).
GRAPH = """
[pipeline]
name = "graph"
async_chunk = false
connector = "none"

[[stages]]
stage_id = 0
name = "listen"
engine = "pkg.mod:make"
final_output = true
final_output_type = "transcript"

[[stages]]
stage_id = 1
name = "prosody"
engine = "pkg.mod:make"
engine_input_source = [0]

[[stages]]
stage_id = 2
name = "thinker"
engine = "pkg.mod:make"
engine_input_source = [0, 1]
custom_process_input_func = "pkg.mod:join"
final_output = true
"""


def test_a_graph_config():
    config = parse_pipeline(GRAPH)
    assert config.stage_inputs == [[], [0], [0, 1]]
    assert config.graph.outputs == ((1, 2), (2,), ())
    assert config.stage_chain == "listen -> prosody, listen -> thinker, prosody -> thinker"
    assert parse_pipeline(GOOD).stage_chain == "stage0 -> stage1"
    assert config.orchestrator_functions.__doc__  # (imports pkg.mod lazily: not called)


def test_a_graph_configs_join_gets_its_inputs_by_stage(monkeypatch):
    import types

    module = types.ModuleType("graphmod")
    module.make = lambda: None
    module.join = lambda outputs: sorted(outputs.items())
    monkeypatch.setitem(__import__("sys").modules, "graphmod", module)
    config = parse_pipeline(GRAPH.replace("pkg.mod", "graphmod"))
    functions = config.orchestrator_functions()
    assert functions["graph"] == [[], [0], [0, 1]]
    input_fn = functions["input_fn"]
    assert input_fn(2, {0: ["hi"], 1: ["calm"]}) == [(0, ["hi"]), (1, ["calm"])]
    assert input_fn(1, {0: ["hi"]}) == ["hi"]  # one input: its list, as before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("engine_input_source = [0]", "engine_input_source = [2]"),
            r"^<config>: stages\.engine_input_source: the stages form a cycle: 1 -> 2 -> 1",
        ),
        (
            ("engine_input_source = [0, 1]", "engine_input_source = []"),
            r"^<config>: stages\[2\]\.custom_process_input_func: stage 2's input is the prompt",
        ),
    ],
)
def test_graph_errors_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_pipeline(GRAPH.replace(*change))


def test_the_fan_in_config_of_the_docs_is_a_valid_graph():
    """docs/config.md's stage graph: listen fans out to prosody and the thinker,
    which joins them."""
    text = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    section = text.split("## Stage graphs", 1)[1]
    sample = section.split("```toml\n", 1)[1].split("```", 1)[0]
    config = parse_pipeline(sample, source="docs/config.md")
    assert config.stage_inputs == [[], [0], [0, 1]]
    assert config.stage_chain == "listen -> prosody, listen -> thinker, prosody -> thinker"
