"""Stages hosted on a Ray cluster (``backend = "ray"``): the third launcher.

A Ray stage's worker is the same ``worker._serve`` as a process stage's, run by a
Ray actor (:class:`_StageActor`) placed by the stage's ``num_cpus``, ``num_gpus``
and ``resources`` on a node of the cluster. The actor connects back to the
orchestrator over TCP, and from then on it speaks the wire protocol on that
connection exactly as a worker process does on its socket pair: Trio reads it
natively, so no thread and no Ray call sits on a request's path -- submits, outputs,
aborts, releases and heartbeats are frames. Chunks go from actor to actor over TCP
links between the workers themselves (``_links``), set up by the connector as for
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
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import msgspec
import trio

from .._util import final, stage_label
from ._backends import LaunchedWorker, WorkerPlace
from ._connection import WorkerStartError
from ._connector import ShmConnector
from ._engine import EngineFactory
from ._options import WorkerOptions
from ._stage import ProcessStage, _importable_path, _open_stage, stage_options

__all__ = [
    "LocalRayCluster",
    "RayLauncher",
    "RaySession",
    "local_ray_cluster",
    "open_ray_session",
    "open_ray_stage",
]

logger = logging.getLogger("omni_trio.process")

#: Ray's blocking calls (init, shutdown, creating actors) at once, in threads.
RAY_THREADS = 4

#: Seconds a killed actor's end may take to be confirmed by Ray (see _ActorHandle.wait).
KILL_CONFIRM = 2.0

#: The bytes of an actor's first line (its hello), at most.
_HELLO_LIMIT = 4096

#: Set in the environment of a local cluster we start: on Linux, Ray then binds every
#: port of its processes to 127.0.0.1 (its node address is the loopback one).
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "backend = 'ray' needs Ray, which is not installed: pip install 'omni-trio[ray]'"
        ) from None
    return ray


# -- the session: this process's connection to a cluster ---------------------------------


@final
@attrs.frozen
class RaySession:
    """This process's connection to a Ray cluster, from :func:`open_ray_session`.

    Attributes:
      address: The address it was opened with (``None``: the cluster the process
          was connected to, or a local one started on loopback).
      host: This node's address, where actors connect back to the orchestrator (and
          where the process stages of a pipeline with Ray stages listen for chunks).
      limiter: Bounds the threads that Ray's blocking calls run in.
    """

    address: str | None
    host: str
    limiter: trio.CapacityLimiter


class _Users:
    """How many open sessions use Ray in this process, and whether we started it
    (``ray.init`` is process-wide: the last one out shuts down what the first one
    started, and nothing it did not)."""

    lock = threading.Lock()
    count = 0
    started = False
    undo_loopback: Callable[[], None] | None = None


def loopback_only() -> Callable[[], None]:
    """Make the Ray nodes this process starts bind every port to 127.0.0.1 (Linux);
    returns what undoes it.

    Ray decides from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``: its processes read it
    from their environment, and this one read it when it imported Ray (into
    ``ray._private.ray_constants.ENABLE_RAY_CLUSTER``), so both are set."""
    ray = _import_ray()
    constants: Any = getattr(getattr(ray, "_private", None), "ray_constants", None)
    had_constant = hasattr(constants, "ENABLE_RAY_CLUSTER")
    constant = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    variable = os.environ.get(_LOOPBACK_ENV)
    if had_constant:
        constants.ENABLE_RAY_CLUSTER = False
    os.environ[_LOOPBACK_ENV] = "0"

    def undo() -> None:
        if had_constant:
            constants.ENABLE_RAY_CLUSTER = constant
        if variable is None:
            os.environ.pop(_LOOPBACK_ENV, None)
        else:
            os.environ[_LOOPBACK_ENV] = variable

    return undo


def _enter(address: str | None) -> str:
    ray = _import_ray()
    with _Users.lock:
        if not ray.is_initialized():
            if address is None:  # a local cluster is nobody else's business: loopback only
                _Users.undo_loopback = loopback_only()
            # Ray's warnings about its defaults (token authentication on, no SIGTERM
            # handler off the main thread: our runtime handles signals) are noise here.
            quiet = logging.getLogger("ray")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                ray.init(address=address, logging_level=logging.ERROR, configure_logging=False)
            finally:
                quiet.setLevel(level)
            _Users.started = True
        _Users.count += 1
        return str(ray.util.get_node_ip_address())


def _leave() -> None:
    ray = _import_ray()
    with _Users.lock:
        _Users.count -= 1
        if _Users.count == 0 and _Users.started:
            _Users.started = False
            ray.shutdown()
            if _Users.undo_loopback is not None:
                _Users.undo_loopback()
                _Users.undo_loopback = None


async def _enter_abandonably(address: str | None) -> str:
    """``_enter`` in a thread, which a cancel abandons: ``ray.init`` cannot be
    interrupted, and a Ctrl-C while it starts a cluster must not wait for it (Ray's
    own processes may be gone with the signal, and it waits a minute for them). A
    session entered after all by the abandoned thread is left by it."""
    lock = threading.Lock()
    state = {"abandoned": False, "entered": False}

    def enter() -> str:
        host = _enter(address)
        with lock:
            state["entered"] = True
            if state["abandoned"]:
                _leave()  # nobody else will
        return host

    try:
        return await trio.to_thread.run_sync(enter, abandon_on_cancel=True)
    except BaseException:
        with lock:
            state["abandoned"] = True
            entered = state["entered"]
        if entered:  # it finished as we were cancelled: leave, without waiting
            threading.Thread(target=_leave, name="omni_trio ray.shutdown", daemon=True).start()
        raise


@asynccontextmanager
async def open_ray_session(address: str | None = None) -> AsyncIterator[RaySession]:
    """Use a Ray cluster in the block: the one this process is connected to already,
    else the one at ``address`` (``"auto"``: the one ``ray start`` runs on this
    machine), else a local one started for the block -- bound to 127.0.0.1 only,
    and shut down when the last block that uses it ends.

    ``ray.init`` takes seconds; it runs in a thread, and is not cancelled halfway.

    Raises:
      RuntimeError: Ray is not installed.
    """
    _import_ray()
    host = await _enter_abandonably(address)
    try:
        yield RaySession(address, host, trio.CapacityLimiter(RAY_THREADS))
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_leave)


# -- the actor --------------------------------------------------------------------------------


class _Hello(msgspec.Struct, frozen=True):
    """An actor's first line on its connection back: which launch it answers, and
    where it runs."""

    token: str
    node_id: str
    node_ip: str
    actor_id: str
    pid: int


class _StageActor:
    """A Ray actor hosting one stage worker (``ray.remote`` is applied when a stage
    is opened: this module imports without Ray)."""

    def serve(self, host: str, port: int, token: str, sys_path: list[str]) -> str:
        """Connect back to the orchestrator at ``host:port`` and serve it there,
        until ``Shutdown`` or until it goes away."""
        import ray
        import trio

        from . import worker

        for path in sys_path:  # engines import as they do in the orchestrator's process
            if path and path not in sys.path and os.path.isdir(path):
                sys.path.append(path)
        context = ray.get_runtime_context()
        node_ip = str(ray.util.get_node_ip_address())
        hello = _Hello(token, context.get_node_id(), node_ip, context.get_actor_id(), os.getpid())
        control = socket.create_connection((host, port))
        control.sendall(msgspec.json.encode(hello) + b"\n")
        trio.run(lambda: worker._serve(control, listen_host=node_ip))
        return "its worker returned"


_remote_class: Any = None


def _actor_class() -> Any:
    global _remote_class
    if _remote_class is None:
        # num_cpus=0 to run, as Ray's own default for actors; placement asks for more
        _remote_class = _import_ray().remote(_StageActor)
    return _remote_class


def _actor_options(options: WorkerOptions) -> dict[str, Any]:
    placement: dict[str, Any] = {"max_restarts": 0}  # we restart, with a new actor
    if options.num_cpus is not None:
        placement["num_cpus"] = options.num_cpus
    if options.num_gpus is not None:
        placement["num_gpus"] = options.num_gpus
    if options.resources:
        placement["resources"] = dict(options.resources)
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
    ray = _import_ray()
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
                _import_ray().kill(self._actor, no_restart=True)
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
    """Each worker is ``worker._serve`` in a new Ray actor, placed as ``options``
    say, which connects back to us over TCP (see the module's docstring)."""

    backend = "ray"

    def __init__(self, session: RaySession, options: WorkerOptions, label: str) -> None:
        self._session = session
        self._options = options
        self._label = label

    async def launch(self, nursery: trio.Nursery) -> LaunchedWorker:
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
    ) -> socket.socket:
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
            return socket.socket(fileno=sock.detach())
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
) -> tuple[trio.socket.SocketType, _Hello]:
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


async def _read_hello(sock: trio.socket.SocketType) -> _Hello | None:
    """An actor's first line, or ``None`` if that is not what came."""
    data = b""
    with trio.move_on_after(10):
        while not data.endswith(b"\n") and len(data) < _HELLO_LIMIT:
            more = await sock.recv(_HELLO_LIMIT - len(data))
            if not more:
                return None
            data += more
    try:
        return msgspec.json.decode(data, type=_Hello)
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
    node and actor. The actor connects back to this process over TCP and serves the
    stage's wire protocol there; in async_chunk mode its chunks go to the next
    stage's worker over TCP, inline. The engine's factory must be importable on the
    node, by the same path.

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
        async with _open_stage(
            _importable_path(engine),
            launcher,
            stage_id=stage_id,
            name=name,
            engine_args=engine_args,
            prefix=prefix,
            connector=connector,
            options=options,
        ) as stage:
            yield stage


# -- a cluster on this machine, for tests and benchmarks ---------------------------------------


@final
@attrs.define
class LocalRayCluster:
    """A running :func:`local_ray_cluster`.

    Attributes:
      cluster: The ``ray.cluster_utils.Cluster`` (``add_node``, ``remove_node``).
      nodes: Its worker nodes (``ray._private.node.Node``; ``.node_id``), in the
          order their resources were given.
    """

    cluster: Any
    nodes: list[Any]

    def add_node(self, resources: Mapping[str, float], cpus: int = 2) -> Any:
        """Start one more worker node with these custom resources (and wait for it).
        Blocks for seconds, and must be called in the main thread (Ray sets signal
        handlers there)."""
        node = self.cluster.add_node(num_cpus=cpus, resources=dict(resources))
        self.cluster.wait_for_nodes()
        self.nodes.append(node)
        return node


@contextmanager
def local_ray_cluster(*nodes: Mapping[str, float], cpus: int = 2) -> Iterator[LocalRayCluster]:
    """A multi-node Ray cluster on this machine, this process connected to it, for
    tests and benchmarks: a head with no CPUs (no actor lands there), and a worker
    node of ``cpus`` CPUs per mapping of custom resources given. Every port binds
    to 127.0.0.1 (:func:`loopback_only`). It blocks for seconds, and must be entered
    in the main thread (Ray sets signal handlers there): before ``trio.run``, or from
    a synchronous fixture. Ray's files go to a directory of its own (``RAY_TMPDIR``
    while it runs), not ``/tmp/ray``: at the end the cluster is stopped and that
    directory removed.
    """
    ray = _import_ray()
    from ray.cluster_utils import Cluster

    undo_loopback = loopback_only()
    temp = tempfile.mkdtemp(prefix="otray-", dir="/tmp")  # short: Unix socket paths
    # Everything of Ray's goes under it, its address file too (Ray writes that into
    # $RAY_TMPDIR/ray, by default /tmp/ray, which need not exist)
    os.mkdir(os.path.join(temp, "ray"))
    saved_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp
    cluster = None
    try:
        head = {"num_cpus": 0, "temp_dir": temp}
        cluster = Cluster(initialize_head=True, connect=True, head_node_args=head)
        started = [cluster.add_node(num_cpus=cpus, resources=dict(r)) for r in nodes]
        cluster.wait_for_nodes()
        yield LocalRayCluster(cluster, started)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        if saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved_tmpdir
        undo_loopback()
