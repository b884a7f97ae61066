"""``omni-trio demo``: an omni pipeline in worker processes, both modes, several
concurrencies -- speaking with eSpeak NG when the ``speech`` extra is installed,
with the simulated engines otherwise."""

from __future__ import annotations

import statistics
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import msgspec
import trio
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .. import RequestMetrics, open_pipeline
from .._audio import write_wav
from ..config import PipelineConfig, shipped_pipeline
from ..timeline import have_matplotlib, plot_timeline

__all__ = [
    "DemoOptions",
    "DemoReport",
    "LevelResult",
    "resolve_engines",
    "results_table",
    "run_demo",
    "template",
]

#: The shipped pipeline of each kind of engines.
_TEMPLATES = {"simulated": "demo", "speech": "speech"}
#: What the table and the timeline call each kind of engines.
_ENGINES = {"speech": "eSpeak NG", "simulated": "simulated"}
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
    tokens_per_second: float = 50.0
    max_tokens: int = 40
    codes_per_second: float = 150.0
    output: Path = Path("omni_trio_demo.wav")
    timeline: Path | None = Path("omni_trio_demo_timeline.png")
    live: bool = True
    #: "speech" (eSpeak NG, the speech extra), "simulated", or "auto": speech when
    #: the extra is installed (see :func:`resolve_engines`).
    engines: str = "auto"

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
    mode: str
    concurrency: int
    requests: int
    ttft: float
    ttfp: float
    e2e: float
    rtf: float
    audio_seconds: float


@attrs.frozen
class DemoReport:
    """What a demo run did.

    Attributes:
      engines: ``"speech"`` or ``"simulated"``: the engines it ran.
      results: One summary per mode and concurrency that finished some request.
      spoken_text: The first request's answer: the text its audio (the WAV) speaks.
      sample_rate: Of the audio, as the pipeline's config says.
      timelines: Per mode, the metrics of its first requests (what the timeline
          picture draws).
      wav: The WAV written, if any request finished.
      timeline: The timeline picture written, if one was asked for, matplotlib is
          installed and some request finished.
    """

    engines: str
    results: list[LevelResult]
    spoken_text: str
    sample_rate: int
    timelines: dict[str, list[RequestMetrics]]
    wav: Path | None
    timeline: Path | None


def resolve_engines(engines: str) -> str:
    """``"auto"``: ``"speech"`` if the speech extra is installed, else ``"simulated"``;
    any other choice as it is."""
    if engines != "auto":
        return engines
    from ..speech import speech_available

    return "speech" if speech_available() else "simulated"


def template(engines: str = "simulated") -> PipelineConfig:
    """The pipeline config shipped for ``engines`` (``"simulated"`` or ``"speech"``)."""
    return shipped_pipeline(_TEMPLATES[engines])


def _configure(
    options: DemoOptions, base: PipelineConfig, engines: str, mode: str
) -> PipelineConfig:
    config = base.with_mode(mode == "async_chunk")
    thinker, talker, code2wav = config.stages
    pace = {"tokens_per_second": options.tokens_per_second, "max_tokens": options.max_tokens}
    thinker = msgspec.structs.replace(thinker, engine_args={**thinker.engine_args, **pace})
    if engines == "simulated":
        talker = msgspec.structs.replace(
            talker,
            engine_args={**talker.engine_args, "codes_per_second": options.codes_per_second},
        )
    return msgspec.structs.replace(config, stages=[thinker, talker, code2wav])


async def _one(
    orch: Any,
    request_id: str,
    prompt: str,
    *,
    sample_rate: int,
    on_text: Any = None,
    audio: bytearray | None = None,
) -> tuple[tuple[float, float, float, float], RequestMetrics]:
    async with orch.open_request(prompt, request_id=request_id) as stream:
        pcm_bytes = 0
        async for out in stream:
            if out.data is None or out.finish_reason in ("aborted", "error"):
                continue
            if out.stage_id == 0 and on_text is not None:
                on_text(out.data)
            elif out.stage_id == 2:
                pcm_bytes += len(out.data)
                if audio is not None:
                    audio += out.data
    terminal = stream.terminal
    assert terminal is not None
    assert terminal.metrics is not None
    if terminal.finish_reason != "completed":
        raise RuntimeError(f"request {request_id}: {terminal.finish_reason}: {terminal.error}")
    metrics = terminal.metrics
    seconds = pcm_bytes / 2 / sample_rate
    measured = (
        metrics.time_to_first_output(0) or 0.0,
        metrics.time_to_first_output(2) or 0.0,
        metrics.e2e_latency,
        seconds,
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
    """
    if stopping is None:
        stopping = trio.Event()
    engines = resolve_engines(options.engines)
    results: list[LevelResult] = []
    first = _First()
    timelines: dict[str, list[RequestMetrics]] = {}
    base = template(engines)
    sample_rate = base.stages[2].sample_rate  # code2wav's, as the config says
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        for mode in options.modes:
            if stopping.is_set():
                break
            config = _configure(options, base, engines, mode)
            async with open_pipeline(config) as pipeline:
                orch = pipeline.orchestrator
                for concurrency in options.concurrency:
                    if stopping.is_set():
                        break
                    level = _Level(
                        orch, options, mode, concurrency, sample_rate, console, progress, stopping
                    )
                    result = await level.run(first if not results else None)
                    if result is not None:
                        results.append(result)
                        timelines.setdefault(mode, level.metrics[:TIMELINE_REQUESTS])
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
            title=f"thinker -> talker -> code2wav ({_ENGINES[engines]} talker and code2wav)",
        )
        await trio.to_thread.run_sync(draw)  # a second of matplotlib, off the loop
        timeline = options.timeline
    text = "".join(first.text)
    return DemoReport(engines, results, text, sample_rate, timelines, wav, timeline)


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
    measured: list[tuple[float, float, float, float]] = attrs.Factory(list)
    metrics: list[RequestMetrics] = attrs.Factory(list)  # in the order the requests started

    async def run(self, first: _First | None) -> LevelResult | None:
        """The level's summary; ``None`` if a graceful stop left it no finished request."""
        count = self.options.requests or max(3, 2 * self.concurrency)
        task = self.progress.add_task(f"{self.mode}, concurrency {self.concurrency}", total=count)
        slots = trio.Semaphore(self.concurrency)
        by_index: list[RequestMetrics | None] = []  # each started request's, once it ends
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
        self.progress.remove_task(task)
        self.metrics = [m for m in by_index if m is not None]
        if not self.measured:
            return None
        return _summarize(self.mode, self.concurrency, self.measured)

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
    mode: str, concurrency: int, measured: list[tuple[float, float, float, float]]
) -> LevelResult:
    ttft, ttfp, e2e, audio = (list(column) for column in zip(*measured, strict=True))
    return LevelResult(
        mode=mode,
        concurrency=concurrency,
        requests=len(measured),
        ttft=statistics.fmean(ttft),
        ttfp=statistics.fmean(ttfp),
        e2e=statistics.fmean(e2e),
        rtf=statistics.fmean(t / a for t, a in zip(e2e, audio, strict=True) if a),
        audio_seconds=statistics.fmean(audio),
    )


def results_table(results: list[LevelResult], engines: str = "simulated") -> Table:
    table = Table(
        title=f"thinker -> talker -> code2wav, a worker process each: {_ENGINES[engines]}"
    )
    for column in ("mode", "conc.", "reqs", "mean TTFT", "mean TTFP", "mean E2E", "RTF"):
        table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=True)
    for r in results:
        table.add_row(
            r.mode,
            str(r.concurrency),
            str(r.requests),
            f"{r.ttft * 1e3:,.0f} ms",
            f"{r.ttfp * 1e3:,.0f} ms",
            f"{r.e2e * 1e3:,.0f} ms",
            f"{r.rtf:.3f}",
        )
    return table
