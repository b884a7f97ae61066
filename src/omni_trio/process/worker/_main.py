"""A worker process's entry point: ``python -m omni_trio.process.worker --control-fd N``."""

from __future__ import annotations

import argparse
import signal
import socket
import sys

import trio

from ..._util import return_large_buffers
from . import _wire as wire
from ._transport import Transport
from ._worker import serve

__all__ = ["main", "serve_socket"]


async def serve_socket(control: socket.socket, transport: Transport | None = None) -> None:
    """:func:`~._worker.serve` on a connected socket of the standard library's (an
    inherited one, or a Ray actor's connection back to its orchestrator), which it
    closes at the end."""
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(control))
    try:
        await serve(stream, transport=transport)
    finally:
        await trio.aclose_forcefully(stream)


def main(argv: list[str] | None = None) -> None:
    """Serve one stage until the orchestrator says ``Shutdown`` or goes away.

    SIGINT and SIGTERM are ignored: a terminal's Ctrl-C, or a ``kill -TERM`` of the
    whole process group, reaches the workers too, but it is their orchestrator's to
    decide what happens to a stage -- it tells them (``Shutdown``), or it goes away
    and their control connection closes; either way a worker exits with status 0,
    quietly. (Trio installs its ``KeyboardInterrupt`` handler only over Python's
    default SIGINT handler, so an ignored SIGINT stays ignored under ``trio.run``.)

    Buffers of 2 MiB or more go back to the system once freed
    (:func:`~omni_trio._util.return_large_buffers`): an engine's large outputs, and
    the frames they go out in, do not stay as RSS once sent.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return_large_buffers()
    parser = argparse.ArgumentParser(prog="python -m omni_trio.process.worker")
    parser.add_argument("--control-fd", type=int, required=True)
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    try:
        trio.run(serve_socket, control)
    except wire.ProtocolError as exc:
        print(f"omni_trio worker: {exc}", file=sys.stderr)
        sys.exit(2)
