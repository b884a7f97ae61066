"""This process's connection to a Ray cluster (``backend = "ray"``).

``ray.init`` is process-wide and takes seconds: :func:`open_ray_session` runs it in a
thread (abandoned, not waited for, if cancelled), counts the blocks that use it, and
the last one out shuts down what the first one started. A local cluster started here
binds every port to 127.0.0.1 (:func:`loopback_only`).

Ray is an optional dependency (the ``ray`` extra): this module imports it only when
a session is opened.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from .._util import final

__all__ = ["RAY_THREADS", "RaySession", "import_ray", "loopback_only", "open_ray_session"]

#: Ray's blocking calls (init, shutdown, creating actors) at once, in threads.
RAY_THREADS = 4

#: Set in the environment of a local cluster we start: on Linux, Ray then binds every
#: port of its processes to 127.0.0.1 (its node address is the loopback one).
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "backend = 'ray' needs Ray, which is not installed: pip install 'omni-trio[ray]'"
        ) from None
    return ray


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
    ray = import_ray()
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
    ray = import_ray()
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
    ray = import_ray()
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
    import_ray()
    host = await _enter_abandonably(address)
    try:
        yield RaySession(address, host, trio.CapacityLimiter(RAY_THREADS))
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_leave)
