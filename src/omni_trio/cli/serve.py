"""``omni-trio serve``: an OpenAI-compatible streaming server for a pipeline (the serve
extra)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..serve import _defaults as defaults
from ._common import (
    Commands,
    UsageError,
    count,
    fail,
    import_path,
    importable,
    pipeline_config,
    pipeline_options,
    port,
    positive_int,
    positive_number,
    priority,
    seconds,
)

if TYPE_CHECKING:
    import trio

    from ..config import PipelineConfig

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible streaming server for a pipeline (the serve extra)",
        description="Serve PIPELINE (a TOML config, or a shipped one: 'demo', the default, "
        "'subtitled', 'speech', 'voice' or 'assistant') over HTTP: GET / (a voice page to "
        "talk to it in a browser), "
        "POST /v1/chat/completions (streamed or not, text and audio), the Realtime API's "
        "WebSocket /v1/realtime (voice in and out, barge-in), POST /v1/audio/speech "
        "(a pipeline with a talker), POST /v1/audio/transcriptions (one that listens), "
        "GET /v1/models, "
        "/health, /metrics. SIGTERM drains: requests in flight finish within "
        "shutdown_grace, new ones get 503. See docs/serving.md.",
    )
    serve.add_argument(
        "pipeline",
        metavar="PIPELINE",
        nargs="?",
        help="a TOML config, or a shipped pipeline: demo, subtitled, speech, voice or "
        "assistant (default: demo)",
    )
    serve.add_argument(
        "--host", default=defaults.HOST, help="the address to listen on (default: %(default)s)"
    )
    serve.add_argument(
        "--port", type=port, default=defaults.PORT, help="0: any free port (default: %(default)s)"
    )
    serve.add_argument(
        "--max-waiting",
        type=count,
        default=defaults.MAX_WAITING,
        metavar="N",
        help="requests that may wait for a max_in_flight slot; more get 503 at once "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=defaults.MAX_REQUEST_BYTES,
        metavar="N",
        help="the largest request body the server reads; a longer one gets 413 "
        "(default: %(default)s, 1 MiB)",
    )
    serve.add_argument(
        "--max-audio-seconds",
        type=positive_number,
        default=defaults.MAX_AUDIO_SECONDS,
        metavar="SECONDS",
        help="the longest audio /v1/audio/transcriptions takes; a longer file gets 400 "
        "(default: %(default)g)",
    )
    serve.add_argument(
        "--write-timeout",
        type=seconds,
        default=defaults.WRITE_TIMEOUT,
        metavar="SECONDS",
        help="a client that leaves the server's writes unread this long (its socket open, "
        "its receive window shut) is disconnected; 0: never (default: %(default)g)",
    )
    serve.add_argument(
        "--no-gc-tuning",
        dest="tune_gc",
        action="store_false",
        help="leave the garbage collector as it is (by default the server freezes the heap "
        "it started with and makes full collections ten times rarer)",
    )
    realtime = serve.add_argument_group("realtime sessions (/v1/realtime, see docs/voice.md)")
    realtime.add_argument(
        "--realtime-max-sessions",
        type=positive_int,
        default=defaults.REALTIME_MAX_SESSIONS,
        metavar="N",
        help="sessions at once; the next upgrade gets 503 (default: %(default)s)",
    )
    realtime.add_argument(
        "--realtime-max-buffer-seconds",
        type=positive_number,
        default=defaults.REALTIME_MAX_BUFFER_SECONDS,
        metavar="SECONDS",
        help="the input audio a session may buffer uncommitted (default: %(default)g)",
    )
    realtime.add_argument(
        "--realtime-max-event-bytes",
        type=positive_int,
        default=defaults.REALTIME_MAX_EVENT_BYTES,
        metavar="N",
        help="the largest client event (default: %(default)s, 1 MiB)",
    )
    realtime.add_argument(
        "--realtime-idle-timeout",
        type=positive_number,
        default=defaults.REALTIME_IDLE_TIMEOUT,
        metavar="SECONDS",
        help="a session with no client event this long (and no response streaming) is "
        "closed (default: %(default)g)",
    )
    realtime.add_argument(
        "--realtime-priority",
        type=priority,
        default=None,
        metavar="N",
        help="its responses' priority, lower first (default: the config's "
        "[serve.priority] realtime, else -10: ahead of chat's 0)",
    )
    realtime.add_argument(
        "--no-realtime-speculation",
        dest="realtime_speculate",
        action="store_false",
        help="recognise a turn only once the VAD ends it, not from the start of its "
        "silence (default: from the start of its silence)",
    )
    pipeline_options(serve, grace="how long a drain lets requests in flight run")
    serve.set_defaults(run=_serve, check=_check)


def _check(args: argparse.Namespace) -> None:
    missing = [m for m in ("hypercorn", "starlette", "prometheus_client") if not importable(m)]
    if missing:
        raise UsageError(
            f"needs the serve extra ({', '.join(missing)} missing): pip install 'omni-trio[serve]'"
        )
    args.config = pipeline_config(args)
    _check_address(args.host, args.port)


def _check_address(host: str, port: int) -> None:
    """Bind ``host:port`` for a moment, as the server will (so a port in use, or a
    host that is none of this machine's addresses, is said now, not after the stages
    started)."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise UsageError(f"--host must be an address of this machine, {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        why = exc.strerror or exc
        # No interface of ours has the address (or its family, IPv6 switched off): the
        # host's fault, whatever the port.
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise UsageError(
                f"--host must be an address of this machine, {host} is not: {why}"
            ) from None
        raise UsageError(f"--port must be free on {host}, {port} is not: {why}") from None


def _serve(args: argparse.Namespace) -> int:
    from functools import partial

    from .._runtime import run_under_signals
    from .._util import return_large_buffers
    from ..config import ConfigError
    from ..process import WorkerStartError

    return_large_buffers()  # a request's large outputs, once freed, do not stay as RSS
    config = args.config
    grace = config.pipeline.shutdown_grace
    directories = (
        [Path.cwd()] if args.pipeline is None else [Path(args.pipeline).parent, Path.cwd()]
    )
    with import_path(*directories):
        try:
            # The server drains within the grace; what runs past twice that (the
            # orchestrator's and the workers' own bounded shutdowns) is cancelled.
            run_under_signals(partial(_serve_main, config, args), grace=2 * grace + 5.0)
        except (ConfigError, WorkerStartError) as exc:  # the pipeline could not start
            return fail(f"omni-trio serve: {exc}", 2)
    return 0


async def _serve_main(
    config: PipelineConfig, args: argparse.Namespace, stopping: trio.Event
) -> None:
    from functools import partial

    import trio

    from .._errors import unwrap_single_exception
    from ..serve import RealtimeOptions, app_for_config, serve

    realtime = RealtimeOptions(
        max_sessions=args.realtime_max_sessions,
        max_buffer_seconds=args.realtime_max_buffer_seconds,
        max_event_bytes=args.realtime_max_event_bytes,
        idle_timeout=args.realtime_idle_timeout,
        speculate=args.realtime_speculate,
        priority=args.realtime_priority,
    )
    app = app_for_config(
        config,
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        realtime=realtime,
        max_audio_seconds=args.max_audio_seconds,
    )
    # The server's error as it is (a WorkerStartError: one line), not in a group.
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            url = await nursery.start(
                partial(
                    serve,
                    app,
                    host=args.host,
                    port=args.port,
                    stopping=stopping,
                    shutdown_grace=config.pipeline.shutdown_grace,
                    write_timeout=args.write_timeout,
                    tune_gc=args.tune_gc,
                )
            )
            print(
                f"omni-trio serve: {config.pipeline.name} ({config.stage_chain}, {config.mode}) "
                f"on {url}",
                flush=True,
            )
