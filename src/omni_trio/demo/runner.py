"""``omni-trio demo``: the simulated omni pipeline, both modes, several concurrencies."""

from __future__ import annotations

import statistics
from importlib.resources import files
from pathlib import Path
from typing import Any

import attrs
import msgspec
import trio
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .. import open_orchestrator
from .._audio import write_wav
from ..config import PipelineConfig, parse_pipeline
from ..process import open_process_pipeline

__all__ = ["DemoOptions", "LevelResult", "results_table", "run_demo", "template"]

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
    live: bool = True

    @classmethod
    def quick(cls, output: Path) -> DemoOptions:
        """Seconds, not tens of seconds: for tests."""
        return cls(
            concurrency=[1, 2],
            requests=2,
            tokens_per_second=400.0,
            max_tokens=10,
            codes_per_second=2000.0,
            output=output,
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


def template() -> PipelineConfig:
    text = files("omni_trio.demo").joinpath("pipeline.toml").read_text()
    return parse_pipeline(text, source="omni_trio/demo/pipeline.toml")


def _configure(options: DemoOptions, mode: str) -> PipelineConfig:
    config = template().with_mode(mode == "async_chunk")
    thinker, talker, code2wav = config.stages
    thinker = msgspec.structs.replace(
        thinker,
        engine_args={
            "tokens_per_second": options.tokens_per_second,
            "max_tokens": options.max_tokens,
        },
    )
    talker = msgspec.structs.replace(
        talker, engine_args={**talker.engine_args, "codes_per_second": options.codes_per_second}
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
) -> tuple[float, float, float, float]:
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
    return (
        metrics.time_to_first_output(0) or 0.0,
        metrics.time_to_first_output(2) or 0.0,
        metrics.e2e_latency,
        seconds,
    )


async def run_demo(
    options: DemoOptions, console: Console, stopping: trio.Event | None = None
) -> list[LevelResult]:
    """Run every mode at every concurrency; write the first request's audio as a WAV.

    Once ``stopping`` is set (a graceful stop: see
    :func:`omni_trio._runtime.run_under_signals`) no new request starts: the ones in
    flight run to their end, and the results cover the levels that completed some.
    """
    if stopping is None:
        stopping = trio.Event()
    results: list[LevelResult] = []
    audio = bytearray()
    sample_rate = template().stages[2].sample_rate  # code2wav's, as the config says
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        for mode in options.modes:
            if stopping.is_set():
                break
            config = _configure(options, mode)
            async with (
                open_process_pipeline(config) as pipeline,
                open_orchestrator(
                    *pipeline.orchestrator_args, **pipeline.orchestrator_kwargs
                ) as orch,
            ):
                for concurrency in options.concurrency:
                    if stopping.is_set():
                        break
                    level = _Level(
                        orch, options, mode, concurrency, sample_rate, console, progress, stopping
                    )
                    result = await level.run(audio if not results else None)
                    if result is not None:
                        results.append(result)
    if audio:
        write_wav(options.output, bytes(audio), sample_rate)
    return results


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

    async def run(self, audio: bytearray | None) -> LevelResult | None:
        """The level's summary; ``None`` if a graceful stop left it no finished request."""
        count = self.options.requests or max(3, 2 * self.concurrency)
        task = self.progress.add_task(f"{self.mode}, concurrency {self.concurrency}", total=count)
        slots = trio.Semaphore(self.concurrency)
        async with trio.open_nursery() as nursery:
            for index in range(count):
                await slots.acquire()  # requests start in order, at most concurrency at once
                if self.stopping.is_set():
                    break  # a graceful stop: the ones running finish, no other starts
                # The very first request is shown live, and its audio goes to the WAV.
                nursery.start_soon(self._request, index, slots, task, audio if index == 0 else None)
        self.progress.remove_task(task)
        if not self.measured:
            return None
        return _summarize(self.mode, self.concurrency, self.measured)

    async def _request(
        self, index: int, slots: trio.Semaphore, task: Any, audio: bytearray | None
    ) -> None:
        prompt = self.options.prompts[index % len(self.options.prompts)]
        live = audio is not None and self.options.live
        if live:
            self.console.print(f"[bold]request 0[/bold] ({self.mode}): {prompt}")
        try:
            result = await _one(
                self.orch,
                f"{self.mode}-{self.concurrency}-{index}",
                prompt,
                sample_rate=self.sample_rate,
                on_text=_printer(self.console) if live else None,
                audio=audio,
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


def results_table(results: list[LevelResult]) -> Table:
    table = Table(title="thinker -> talker -> code2wav, one worker process each")
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
