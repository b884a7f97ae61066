"""``omni-trio run``: one request streamed through a pipeline config: a text prompt,
or a spoken one (``--audio``, a WAV file) for a pipeline that listens."""

from __future__ import annotations

import argparse
import base64
import json
import sys
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._common import (
    Commands,
    UsageError,
    check_output,
    fail,
    import_path,
    importable,
    pipeline_config,
    pipeline_options,
    positive_int,
    text,
)

if TYPE_CHECKING:
    from ..config import PipelineConfig

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    run = commands.add_parser(
        "run",
        help="stream one request through a pipeline config (TOML)",
        description="Start the stages of PIPELINE (a TOML config, or a shipped one: "
        "'demo', the simulated pipeline; 'subtitled', the same with timed subtitles; "
        "'speech', eSpeak NG's, the speech extra; or 'voice', which listens first, the "
        "voice extra) and stream one request: text as it comes, what a listening stage "
        "heard as 'heard: ...', subtitles as '[start --> end] text' lines (and written "
        "with --vtt), audio counted (and written with --wav). "
        "The config's directory and the current directory are put on the import path "
        "(of this process and of the workers), so engines beside the config are found.",
    )
    run.add_argument("pipeline", metavar="PIPELINE")
    prompt = run.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", type=text, metavar="TEXT", help="the prompt")
    prompt.add_argument(
        "--prompt-file", metavar="PATH", help="read the prompt from PATH ('-': standard input)"
    )
    prompt.add_argument(
        "--audio",
        metavar="PATH",
        help="say the prompt: a WAV file of 16-bit mono PCM, any rate, for a pipeline that "
        "listens (a stage with final_output_type = \"transcript\", as 'voice' has)",
    )
    run.add_argument("--wav", metavar="PATH", help="write the audio outputs to this WAV file")
    run.add_argument(
        "--vtt", metavar="PATH", help="write the subtitles to this WebVTT file (a .vtt)"
    )
    run.add_argument(
        "--timeline",
        metavar="PATH",
        help="draw the request's stages (submit to completion, first outputs) as a PNG "
        "(the plot extra)",
    )
    run.add_argument(
        "--sample-rate",
        type=positive_int,
        metavar="HZ",
        help="of the audio, overriding the audio stage's sample_rate in the config",
    )
    pipeline_options(run, grace="how long stopping may take before what is left is killed")
    run.add_argument(
        "--json",
        action="store_true",
        help="print every output as a line of JSON (the terminal last, with its metrics); "
        "audio data as base64",
    )
    run.set_defaults(run=_run, check=_check)


def _check(args: argparse.Namespace) -> None:
    args.config = pipeline_config(args)
    if args.timeline is not None:
        check_output("--timeline", args.timeline)
        if not importable("matplotlib"):
            raise UsageError(
                "--timeline needs matplotlib, which is not installed: pip install 'omni-trio[plot]'"
            )
    audio = [s for s in args.config.stages if s.final_output and s.final_output_type == "audio"]
    if args.wav is not None:
        if not audio:
            raise UsageError(f"--wav needs an audio final stage, {args.pipeline} has none")
        check_output("--wav", args.wav)
    if args.vtt is not None:
        if not any(
            s.final_output and s.final_output_type == "subtitles" for s in args.config.stages
        ):
            raise UsageError(f"--vtt needs a subtitles final stage, {args.pipeline} has none")
        check_output("--vtt", args.vtt)
    if args.sample_rate is None:
        args.sample_rate = audio[0].sample_rate if audio else None
    _check_listening(args)
    if args.prompt_file is not None:
        name = "standard input" if args.prompt_file == "-" else repr(args.prompt_file)
        try:
            if args.prompt_file == "-":
                prompt = sys.stdin.read()
            else:
                prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(
                f"--prompt-file must name a readable file, {name}: {exc.strerror or exc}"
            ) from None
        except ValueError:
            raise UsageError(f"--prompt-file must hold UTF-8 text, {name} does not") from None
        args.prompt = prompt.strip()
        if not args.prompt:
            raise UsageError(f"--prompt-file must hold a prompt, {name} is empty")


#: The listen stage's engine, which needs faster-whisper (the voice extra).
_LISTEN = "omni_trio.speech:listen"


def _check_listening(args: argparse.Namespace) -> None:
    """A pipeline that listens needs faster-whisper; ``--audio`` needs a pipeline that
    listens, and a WAV file of 16-bit mono PCM, which becomes the prompt (an
    utterance)."""
    config: PipelineConfig = args.config
    listens = [s for s in config.stages if s.engine == _LISTEN]
    if listens and not importable("faster_whisper"):
        raise UsageError(
            f"the {listens[0].label} stage of {args.pipeline} needs faster-whisper, which is "
            "not installed: pip install 'omni-trio[voice]'"
        )
    if args.audio is None:
        return
    if not any(s.final_output_type == "transcript" for s in config.stages):
        raise UsageError(
            f"--audio needs a pipeline that listens (a stage with final_output_type = "
            f'"transcript"), {args.pipeline} has none'
        )
    pcm, sample_rate = _read_wav(args.audio)
    from ..speech import utterance

    args.prompt = utterance(audio=pcm, sample_rate=sample_rate)


def _read_wav(path: str) -> tuple[bytes, int]:
    """A WAV file's 16-bit mono PCM and its rate.

    Raises:
      UsageError: it cannot be read, is no WAV file, or holds other audio.
    """
    try:
        with wave.open(path, "rb") as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            pcm = wav.readframes(wav.getnframes())
    except OSError as exc:
        raise UsageError(
            f"--audio must name a readable file, {path!r}: {exc.strerror or exc}"
        ) from None
    except (wave.Error, EOFError) as exc:
        raise UsageError(
            f"--audio must be a WAV file of 16-bit mono PCM, {path!r} is not a WAV file "
            f"Python reads ({exc or 'it ends early'})"
        ) from None
    if (channels, width) != (1, 2):
        raise UsageError(
            f"--audio must be a WAV file of 16-bit mono PCM, {path!r} holds {8 * width}-bit "
            f"audio in {channels} channel(s)"
        )
    return pcm, rate


def _run(args: argparse.Namespace) -> int:
    from .._runtime import run_under_signals
    from ..config import ConfigError
    from ..process import WorkerStartError

    with import_path(Path(args.pipeline).parent, Path.cwd()):
        try:
            grace = args.config.pipeline.shutdown_grace
            return int(
                run_under_signals(lambda _stopping: _run_one(args.config, args), grace=grace)
            )
        except (ConfigError, WorkerStartError) as exc:  # the pipeline could not start
            return fail(f"omni-trio run: {exc}", 2)


def _output_json(out: Any, names: dict[int, str]) -> dict[str, Any]:
    """One output as JSON: bytes (audio) as base64, with ``data_encoding: "base64"``."""
    data, encoding = out.data, None
    if isinstance(data, bytes | bytearray | memoryview):
        data, encoding = base64.b64encode(data).decode("ascii"), "base64"
    record = {
        "request_id": out.request_id,
        "stage_id": out.stage_id,
        "stage": names.get(out.stage_id),
        "data": data,
        "data_encoding": encoding,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "error": out.error,
    }
    metrics = out.metrics
    if metrics is not None:
        arrival = metrics.arrival_time
        record["metrics"] = {
            "e2e_latency": metrics.e2e_latency,
            "time_to_first_output": {
                str(k): t - arrival for k, t in sorted(metrics.first_output_times.items())
            },
            "stage_submit_latency": {
                str(k): t - arrival for k, t in sorted(metrics.stage_submit_times.items())
            },
            "stage_finish_latency": {
                str(k): t - arrival for k, t in sorted(metrics.stage_finish_times.items())
            },
            "num_outputs": metrics.num_outputs,
        }
    return record


async def _run_one(config: PipelineConfig, args: argparse.Namespace) -> int:
    from functools import partial

    import trio
    from rich.console import Console

    from .. import open_pipeline
    from .._audio import write_wav

    types = config.final_output_types  # what the user gets: outputs of final stages only
    names = config.stage_names
    audio = bytearray()
    cues: list[str] = []
    console = Console(quiet=args.json)  # with --json, stdout is the JSON lines alone
    console.print(
        f"{config.pipeline.name}: {config.stage_chain} ({config.mode})",
        markup=False,
        highlight=False,
    )
    line_open = False  # text printed on the current line
    async with (
        open_pipeline(config) as pipeline,
        pipeline.orchestrator.open_request(args.prompt) as stream,
    ):
        async for out in stream:
            if args.json:
                print(json.dumps(_output_json(out, names), default=repr), flush=True)
            if out.data is None or out.finish_reason in ("aborted", "error"):
                continue  # a bare completion shows as nothing
            kind = types.get(out.stage_id)
            if kind == "audio":
                audio += out.data
            elif kind == "transcript":  # the user's words: a line of their own
                if line_open:
                    console.out("")
                console.out(f"heard: {out.data or '(nothing)'}", highlight=False)
                line_open = False
            elif kind == "subtitles":  # a timed cue: a line of its own too
                if line_open:
                    console.out("")
                cues.append(str(out.data))
                timing, _, words = str(out.data).partition("\n")
                console.out(f"[{timing}] {words}", highlight=False)
                line_open = False
            else:
                console.out(str(out.data), end="", highlight=False)
                line_open = True
    console.out("")
    terminal = stream.terminal
    assert terminal is not None
    if terminal.finish_reason != "completed":
        return fail(f"omni-trio run: {terminal.finish_reason}: {terminal.error or 'no cause'}", 1)
    metrics = terminal.metrics
    assert metrics is not None
    firsts = ", ".join(
        f"{names[k]} {(metrics.time_to_first_output(k) or 0.0) * 1e3:,.0f} ms"
        for k in sorted(metrics.first_output_times)
    )
    console.print(
        f"completed in {metrics.e2e_latency * 1e3:,.0f} ms; first output: {firsts}",
        highlight=False,
    )
    if audio:
        seconds = len(audio) / 2 / args.sample_rate
        console.print(
            f"{len(audio):,} bytes of audio ({seconds:.2f} s at {args.sample_rate:,} Hz)",
            highlight=False,
        )
        if args.wav:
            try:
                write_wav(args.wav, bytes(audio), args.sample_rate)
            except OSError as exc:
                return fail(f"omni-trio run: cannot write {args.wav}: {exc}", 1)
            console.print(f"written to {args.wav}", highlight=False)
    if args.vtt:
        try:
            vtt = "WEBVTT\n\n" + "\n\n".join(cues) + "\n"
            await trio.Path(args.vtt).write_text(vtt, encoding="utf-8")
        except OSError as exc:
            return fail(f"omni-trio run: cannot write {args.vtt}: {exc}", 1)
        console.print(f"{len(cues)} subtitles written to {args.vtt}", highlight=False)
    if args.timeline:
        from ..timeline import plot_timeline

        draw = partial(
            plot_timeline,
            args.timeline,
            {config.mode: [metrics]},
            stage_names=names,
            output_types=types,
            title=f"{config.pipeline.name}: {' -> '.join(names.values())}",
        )
        try:
            await trio.to_thread.run_sync(draw)
        except OSError as exc:
            return fail(f"omni-trio run: cannot write {args.timeline}: {exc}", 1)
        console.print(f"timeline drawn in {args.timeline}", highlight=False, soft_wrap=True)
    return 0
