"""Serving an app with Hypercorn's Trio worker, and draining it on a graceful stop."""

from __future__ import annotations

import gc
import logging
import socket
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial

import hypercorn.trio.run
import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import LifespanFailureError, wrap_app
from starlette.applications import Starlette

from .._checks import check_seconds
from .._errors import unwrap_single_exception
from . import _defaults as defaults
from ._app import server_state
from ._state import ServerState

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["serve"]

#: Seconds the server gives open connections to take their last bytes once it stops.
_CLOSE_GRACE = 2.0
#: While a server runs, a full garbage collection comes at most once per this many
#: collections of the middle generation (CPython's default: 10).
FULL_COLLECTION_EVERY = 100
logger = logging.getLogger("omni_trio.serve")


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(
    app: Starlette,
    *,
    host: str = defaults.HOST,
    port: int = defaults.PORT,
    stopping: trio.Event | None = None,
    shutdown_grace: float = 5.0,
    write_timeout: float = defaults.WRITE_TIMEOUT,
    tune_gc: bool = True,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` (from :func:`create_app`) over HTTP until cancelled or stopped.

    Start it with ``url = await nursery.start(partial(serve, app, port=0))``: it
    reports its URL (``http://127.0.0.1:PORT``, with the port the system chose for
    ``port=0``) once the app's lifespan has started the pipeline and the socket
    listens.

    Setting ``stopping`` is a graceful stop (what ``omni-trio serve`` does on
    SIGTERM): ``/health`` and new requests get 503 at once, the requests in flight
    get up to ``shutdown_grace`` seconds to finish, and the rest are ended (each
    client is told, each request aborted at its stages); then the listener closes,
    the lifespan ends (the orchestrator and the stages shut down), and this returns.
    Cancelling it ends everything at once, the same way, without the grace.

    ``write_timeout``: a client that leaves the server's writes unread for this many
    seconds -- its socket open, its receive window shut -- is disconnected by the
    kernel (``TCP_USER_TIMEOUT``, on Linux): its response ends as a hang-up does, and
    a stop never waits longer than that for it (Hypercorn's writes cannot be
    cancelled). ``0`` turns it off.

    ``tune_gc`` (the default): while it serves, the process's garbage collector
    leaves alone what the process held once the pipeline started (:func:`gc.freeze`),
    and its full collections come at most once per :data:`FULL_COLLECTION_EVERY`
    collections of the middle generation (ten times rarer than CPython's default): a
    full collection stops every stream for as long as it scans the heap. Both are
    restored once the last server in the process stops. ``False`` leaves the
    collector as the process has it (an application that tunes it itself).

    Raises:
      OSError: the address could not be bound.
      Exception: what the app's lifespan raised starting the pipeline (a
          :class:`~omni_trio.process.WorkerStartError`, say), as it raised it.
      ValueError: ``shutdown_grace`` or ``write_timeout`` is not a number of
          seconds >= 0.
    """
    check_seconds("shutdown_grace", shutdown_grace, positive=False)
    check_seconds("write_timeout", write_timeout, positive=False)
    state = server_state(app)
    config = Config()
    config.bind = [_bind(host, port)]
    config.accesslog = None
    config.errorlog = logger  # no "Running on ..." banner; errors still reach logging
    config.graceful_timeout = _CLOSE_GRACE
    config.startup_timeout = 600.0  # the stages' own start timeouts bound it
    config.shutdown_timeout = 600.0  # the orchestrator's and stages' graces bound it
    trigger = None if stopping is None else partial(_drain, state, stopping, shutdown_grace)
    try:
        with unwrap_single_exception(), ExitStack() as serving:
            serving.enter_context(_guarded_connections())
            async with trio.open_nursery() as nursery:
                urls = await nursery.start(
                    partial(
                        worker_serve,
                        wrap_app(app, config.wsgi_max_body_size, None),  # type: ignore[arg-type]
                        config,
                        sockets=_listening(config, write_timeout),
                        shutdown_trigger=trigger,
                    )
                )
                if state.orchestrator is None:
                    # Hypercorn reports its start even when the lifespan failed (its
                    # startup event is set as the failure unwinds); the failure
                    # reaches this nursery at its next checkpoint: wait for it, and
                    # report no URL of a server that serves nothing.
                    await trio.sleep_forever()
                if tune_gc:
                    serving.enter_context(_steady_heap())
                task_status.started(urls[0])
    except BaseException as exc:
        error = state.startup_error
        if error is not None and _lifespan_failed(exc):
            raise error from None  # the pipeline's own error, not Hypercorn's wrapping
        raise


def _listening(config: Config, write_timeout: float) -> Sockets:
    """Hypercorn's sockets for ``config``, listening, with the write timeout set: an
    accepted connection inherits it from its listener."""
    sockets = config.create_sockets()
    option = getattr(socket, "TCP_USER_TIMEOUT", None)  # Linux
    for sock in sockets.insecure_sockets:
        if write_timeout and option is not None and sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, option, round(write_timeout * 1000))
        sock.listen(config.backlog)
    return sockets


class _Connection(TCPServer):
    """Hypercorn's connection (its Trio worker's ``TCPServer``), safe when a client
    closes while the server writes or closes.

    Hypercorn writes a connection's bytes under its ``send_lock`` but closes it
    (``_close``: ``send_eof``, then ``aclose``) without the lock. Trio counts
    ``send_eof`` as a write and holds the stream's one-writer check across a
    checkpoint: a write from another task in that step raises
    ``trio.BusyResourceError`` -- the reader answering the client's Close frame, say,
    while the app's task (its app returned) closes the connection. Hypercorn let
    that error out of the connection into its listener's nursery, which ended
    ``serve`` for every client. Here the close takes the lock too, and an error of
    one connection is logged and closes that connection alone.
    """

    async def run(self) -> None:
        try:
            await super().run()
        except Exception as exc:
            await self._failed(exc)
        except BaseExceptionGroup as group:  # errors, or none, beside a cancellation
            errors, rest = group.split(Exception)
            if errors is None:
                raise
            await self._failed(errors)
            if rest is not None:
                raise rest from None

    async def _failed(self, error: Exception) -> None:
        """What escaped the connection (a bug in Hypercorn, or below it): logged, and
        the connection closed; the server goes on."""
        client = getattr(getattr(self, "protocol", None), "client", None)  # set by run()
        logger.error(
            "the connection of client %s failed: closed it (the server goes on)",
            client,
            exc_info=error,
        )
        await trio.aclose_forcefully(self.stream)

    async def _close(self) -> None:
        """Hypercorn's close (``send_eof``, ``aclose``), under the write lock."""
        lock = self.send_lock
        if lock.statistics().owner is trio.lowlevel.current_task():
            await super()._close()  # closing from its own write: no other is under way
            return
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            # A write is under way or waits its turn, perhaps on a client that reads
            # nothing (up to write_timeout): close now, without the EOF, as Hypercorn
            # does when it finds the stream busy. The write gets ClosedResourceError,
            # which Hypercorn takes for the connection's end.
            await self.stream.aclose()
            return
        try:
            await super()._close()
        finally:
            lock.release()


_guarded = 0  # servers running in this process that guard their connections
_hypercorns_connection: type[TCPServer] = TCPServer
#: The names of Hypercorn's Trio worker's module, where ``worker_serve`` finds its
#: connection class.
_WORKER = vars(hypercorn.trio.run)


@contextmanager
def _guarded_connections() -> Iterator[None]:
    """While a server runs, Hypercorn's Trio worker makes each connection a
    :class:`_Connection`.

    ``worker_serve`` offers no choice of the class: it makes its connections with
    the name ``TCPServer`` of its module, so that name is :class:`_Connection` while
    any server of this process runs, and Hypercorn's own again once the last stops.
    (Another Hypercorn server run in this process meanwhile gets it too: it only
    serializes a connection's writes and keeps one connection's error to itself.)
    """
    global _guarded, _hypercorns_connection
    if not _guarded:
        _hypercorns_connection = _WORKER["TCPServer"]
        _WORKER["TCPServer"] = _Connection
    _guarded += 1
    try:
        yield
    finally:
        _guarded -= 1
        if not _guarded:
            _WORKER["TCPServer"] = _hypercorns_connection


_steady = 0  # servers running in this process (tests run several)
_thresholds = gc.get_threshold()
_frozen_before = False  # the process had frozen objects of its own


@contextmanager
def _steady_heap() -> Iterator[None]:
    """While the server runs: what the process holds once the pipeline started is
    frozen (:func:`gc.freeze`: no collection scans it again), and full collections
    are rarer (:data:`FULL_COLLECTION_EVERY`).

    A full collection stops the server's one thread while it scans every object the
    process holds -- 35 to 70 ms with 200 streams open, each stream's chunks waiting
    -- and streams that live for seconds make them come every few seconds. Frozen,
    the startup's objects (modules, the pipeline) are not scanned; what streams
    leave behind is still collected, by the young generations' collections and the
    rarer full ones. The first server in a process saves the collector's settings,
    the last one to stop restores them and unfreezes (unless the process had frozen
    objects of its own before).
    """
    global _steady, _thresholds, _frozen_before
    if not _steady:
        _thresholds = gc.get_threshold()
        _frozen_before = gc.get_freeze_count() > 0
        young, middle, full = _thresholds
        gc.set_threshold(young, middle, max(full, FULL_COLLECTION_EVERY))
    _steady += 1
    gc.freeze()
    try:
        yield
    finally:
        _steady -= 1
        if not _steady:
            gc.set_threshold(*_thresholds)
            if not _frozen_before:
                gc.unfreeze()


def _lifespan_failed(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(LifespanFailureError) is not None
    return isinstance(exc, LifespanFailureError)


async def _drain(state: ServerState, stopping: trio.Event, grace: float) -> None:
    """Return (so Hypercorn closes its listener) once a graceful stop is done."""
    await stopping.wait()
    state.draining = True
    with trio.move_on_after(grace):
        await state.wait_idle()
    state.cancel_all()
    with trio.move_on_after(_CLOSE_GRACE):
        await state.wait_idle()
