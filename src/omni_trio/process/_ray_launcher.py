"""Stages hosted on a Ray cluster (``backend = "ray"``): the third launcher.

A Ray stage's worker is the same ``serve`` as a process stage's, run by a Ray actor
(the worker package's ``StageActor``) placed by the stage's ``num_cpus``, ``num_gpus``
and ``resources`` on a node of the cluster. The actor connects back to the
orchestrator over TCP, and from then on it speaks the wire protocol on that
connection exactly as a worker process does on its socket pair: Trio reads it
natively, so no thread and no Ray call sits on a request's path -- submits, outputs,
aborts, releases and heartbeats are frames. Chunks go from actor to actor over TCP
links between the workers themselves, set up by the connector as for
processes.

Ray's own API is used only around a worker's life, and never blocks the Trio loop:
``ray.init``, ``ray.shutdown`` and actor creation run in threads (bounded by the
session's :class:`trio.CapacityLimiter`); the end of an actor is learnt from the
``concurrent.futures.Future`` of its ``serve`` call, resolved by Ray's own thread
and handed to Trio through :meth:`trio.lowlevel.TrioToken.run_sync_soon`;
``ray.kill`` returns at once (it sends a message) and is called directly.

Why a connection back rather than Ray calls (measured on this machine, see
docs/cluster.md): an actor call round trip costs about 1.1 ms and a streaming
generator about 0.6 ms of CPU per item, against tens of microseconds per frame on
a socket that carries many outputs per read; and abort, backpressure and death
detection are the wire protocol's already.

Ray is an optional dependency (the ``ray`` extra): this module imports it only when
a Ray stage is opened.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import secrets
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio

from .._util import final, stage_label
from ._connection import WorkerStartError
from ._connector import ShmConnector
from ._launcher import LaunchedWorker, WorkerPlace
from ._open import importable_path, open_stage, stage_options
from ._options import WorkerOptions
from ._ray_session import RaySession, import_ray, open_ray_session
from ._stage import ProcessStage
from .worker._engine import EngineFactory
from .worker._ray_actor import Hello, StageActor

__all__ = ["RayLauncher", "open_ray_stage"]

logger = logging.getLogger("omni_trio.process")

#: Seconds a killed actor's end may take to be confirmed by Ray (see _ActorHandle.wait).
KILL_CONFIRM = 2.0

#: The bytes of an actor's first line (its hello), at most.
_HELLO_LIMIT = 4096


_remote_class: Any = None


def _actor_class() -> Any:
    global _remote_class
    if _remote_class is None:
        # num_cpus=0 to run, as Ray's own default for actors; placement asks for more
        _remote_class = import_ray().remote(StageActor)
    return _remote_class


def _actor_options(options: WorkerOptions) -> dict[str, Any]:
    """Ray's options for each actor of the stage, every replica's and every
    replacement's alike: what it asks a node for, never which node (Ray places a
    replacement wherever there is room, among the nodes that are left)."""
    placement: dict[str, Any] = {"max_restarts": 0}  # we restart, with a new actor
    if options.num_cpus is not None:
        placement["num_cpus"] = options.num_cpus
    if options.num_gpus is not None:
        placement["num_gpus"] = options.num_gpus
    if options.resources:
        placement["resources"] = dict(options.resources)
    if options.spread:
        placement["scheduling_strategy"] = "SPREAD"
    return placement


def _placement(options: WorkerOptions) -> str:
    """What an actor asks its node for, for messages: ``{num_cpus: 1, node_tts: 1}``."""
    wants = {"num_cpus": 1 if options.num_cpus is None else options.num_cpus}
    if options.num_gpus:
        wants["num_gpus"] = options.num_gpus
    wants.update(options.resources)
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in wants.items()) + "}"


def _death(exc: BaseException) -> str:
    """Why an actor's ``serve`` call ended with ``exc``, in a line."""
    ray = import_ray()
    if isinstance(exc, ray.exceptions.RayActorError):
        because = [
            line.strip()
            for line in str(exc).splitlines()
            if line.strip().startswith(("The actor is dead because", "The actor died because"))
        ]
        if because:  # "The actor died because its node has died. ..." -> "its node has died"
            cause = because[-1].split(" because ", 1)[1].split(". ", 1)[0].rstrip(".")
            return f"its Ray actor died: {cause}"
        return f"its Ray actor died ({type(exc).__name__})"
    first = str(exc).strip().splitlines()
    return f"its Ray actor raised {type(exc).__name__}" + (f": {first[-1]}" if first else "")


@final
class _ActorHandle:
    """A Ray stage's worker, as its connection stops it."""

    def __init__(self, actor: Any, serving: concurrent.futures.Future[Any]) -> None:
        self.pid: int | None = None
        self.place: WorkerPlace | None = None
        self._actor = actor
        self._killed = False
        self._ended = trio.Event()
        self._reason = "not ended"
        token = trio.lowlevel.current_trio_token()

        def done(future: concurrent.futures.Future[Any]) -> None:  # in Ray's thread
            with contextlib.suppress(trio.RunFinishedError):  # nobody waits any more
                token.run_sync_soon(self._end, future)

        serving.add_done_callback(done)

    def _end(self, future: concurrent.futures.Future[Any]) -> None:
        exc = future.exception()
        self._reason = str(future.result()) if exc is None else _death(exc)
        self._ended.set()

    def kill(self) -> None:
        """``ray.kill``: the actor ends without restarting. Returns at once (the
        kill is a message to Ray; :meth:`wait` waits for its effect)."""
        if not self._killed:
            self._killed = True
            try:
                import_ray().kill(self._actor, no_restart=True)
            except Exception:  # Ray is shut down, or knows the actor as dead
                logger.debug("ray.kill failed", exc_info=True)

    async def wait(self) -> str:
        """Wait for the actor's end, as Ray reports it; once we killed it, for
        ``KILL_CONFIRM`` seconds at most (a dead node's actors are confirmed dead
        only when Ray notices the node is gone)."""
        if self._killed:
            with trio.move_on_after(KILL_CONFIRM):
                await self._ended.wait()
            if not self._ended.is_set():
                return f"killed (Ray did not confirm its end within {KILL_CONFIRM:g} s)"
        await self._ended.wait()
        return self._reason


@final
class RayLauncher:
    """Each worker is the worker package's ``serve`` in a new Ray actor, placed as
    ``options`` say, which connects back to us over TCP (see the module's docstring)."""

    backend = "ray"

    def __init__(self, session: RaySession, options: WorkerOptions, label: str) -> None:
        self._session = session
        self._options = options
        self._label = label

    async def launch(self, nursery: trio.Nursery, *, name: str) -> LaunchedWorker:
        session, options = self._session, self._options
        listener = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with listener:
            await listener.bind((session.host, 0))
            listener.listen(8)
            port = listener.getsockname()[1]
            token = secrets.token_hex(16)

            def create() -> tuple[Any, concurrent.futures.Future[Any]]:
                actor = _actor_class().options(**_actor_options(options)).remote()
                serving = actor.serve.remote(session.host, port, token, sys.path)
                return actor, serving.future()

            actor, serving = await trio.to_thread.run_sync(create, limiter=session.limiter)
            handle = _ActorHandle(actor, serving)
            try:
                control = await self._accept(listener, token, handle)
            except BaseException:
                handle.kill()
                raise
        return LaunchedWorker(handle, control)

    async def _accept(
        self, listener: trio.socket.SocketType, token: str, handle: _ActorHandle
    ) -> trio.SocketStream:
        """The actor's connection back, once it said who it is."""
        timeout = self._options.startup_timeout
        accepted = None
        with trio.move_on_after(timeout) as waited:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:  # an actor that ends before it connects
                    await handle.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                accepted = await _accept_hello(listener, token)
                nursery.cancel_scope.cancel()
        if accepted is not None:
            sock, hello = accepted
            handle.pid = hello.pid
            handle.place = WorkerPlace(hello.node_id, hello.node_ip, hello.actor_id)
            return trio.SocketStream(sock)
        if waited.cancelled_caught:
            raise WorkerStartError(
                f"{self._label}: no Ray node took its actor within {timeout:g} s "
                f"(startup_timeout): it asks for {_placement(self._options)}"
            )
        raise WorkerStartError(
            f"{self._label}: its Ray actor ended before it connected: {await handle.wait()}"
        )


async def _accept_hello(
    listener: trio.socket.SocketType, token: str
) -> tuple[trio.socket.SocketType, Hello]:
    """The first connection that says ``token`` in its hello."""
    while True:
        sock, _ = await listener.accept()
        try:
            hello = await _read_hello(sock)
        except BaseException:
            sock.close()
            raise
        if hello is not None and secrets.compare_digest(hello.token, token):
            return sock, hello
        sock.close()  # not our actor


async def _read_hello(sock: trio.socket.SocketType) -> Hello | None:
    """An actor's first line, or ``None`` if that is not what came."""
    data = b""
    with trio.move_on_after(10):
        while not data.endswith(b"\n") and len(data) < _HELLO_LIMIT:
            more = await sock.recv(_HELLO_LIMIT - len(data))
            if not more:
                return None
            data += more
    try:
        return msgspec.json.decode(data, type=Hello)
    except msgspec.DecodeError:
        return None


@asynccontextmanager
async def open_ray_stage(
    engine: str | EngineFactory,
    *,
    stage_id: int = 0,
    name: str | None = None,
    engine_args: Mapping[str, Any] | None = None,
    prefix: str | None = None,
    connector: ShmConnector | None = None,
    options: WorkerOptions | None = None,
    ray_address: str | None = None,
) -> AsyncIterator[ProcessStage]:
    """Run ``engine`` in a Ray actor and use it as a stage in the block.

    The same engine, arguments and stage as :func:`open_process_stage`, with the
    worker in an actor on a node of a Ray cluster instead of a child process:
    ``options.num_cpus``, ``num_gpus`` and ``resources`` place it, its restarts are
    new actors (``options.restart``, ``max_restarts``), and its statistics name its
    node and actor. With ``options.replicas``, each replica is an actor of its own,
    placed alike (``options.spread``: by Ray's ``SPREAD`` strategy), and a replica
    lost with its node is replaced on a node that is left. The actor connects back
    to this process over TCP and serves the stage's wire protocol there; in
    async_chunk mode its chunks go to the next stage's worker over TCP, inline. The
    engine's factory must be importable on the node, by the same path.

    The cluster is the one this process is connected to, else ``ray_address``'s,
    else a local one started for the block, on loopback only (see
    :func:`open_ray_session`).

    Leaving the block stops the worker (``Shutdown``, then ``ray.kill`` after
    ``options.shutdown_grace`` at the latest) and kills its actor.

    Raises:
      WorkerStartError: the worker could not be started: no node took its actor
          within ``startup_timeout``, or it could not load its engine.
      RuntimeError: Ray is not installed.
    """
    options = stage_options(options, "ray")  # checked before Ray takes seconds to start
    async with open_ray_session(ray_address) as session:
        launcher = RayLauncher(session, options, stage_label(stage_id, name or f"stage{stage_id}"))
        async with open_stage(
            importable_path(engine),
            launcher,
            stage_id=stage_id,
            name=name,
            engine_args=engine_args,
            prefix=prefix,
            connector=connector,
            options=options,
        ) as stage:
            yield stage
