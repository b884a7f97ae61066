"""Tools for testing code that runs stages (and omni_trio's own process wing).

:func:`local_ray_cluster` starts a multi-node Ray cluster on this machine, bound to
loopback (it is also importable from :mod:`omni_trio.process`, where it lived first).
:class:`MemoryNetwork` links workers through in-memory streams instead of sockets.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import trio
import trio.testing

from .._util import final
from ._ray_session import import_ray, loopback_only
from .worker._shm import SHM, Segments

__all__ = ["LocalRayCluster", "MemoryNetwork", "local_ray_cluster"]


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
    ray = import_ray()
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


# -- chunk links in memory -----------------------------------------------------------------


@final
class MemoryNetwork:
    """Chunk links through memory: a transport for workers of one process.

    Give the same network to every worker of a pipeline (``serve(control,
    transport=network)``): a worker listens at ``mem:<name>``, and a worker that
    connects there gets one end of a :func:`trio.testing.memory_stream_pair`, its
    reader the other. Nothing touches a socket, so a test can run workers over memory
    and drive their streams (wrap them, delay them, break them) as it likes.

    Args:
      shared_memory: Whether links may carry ring offsets (default: yes; the workers
          share this process, and so its shared memory). ``False`` sends every chunk
          inline, as a TCP link does.
      segments: Where the workers' rings live (default: files in ``/dev/shm``, as a
          worker process's); a simulation gives ``MemorySegments()``, buffers of this
          process.

    Attributes:
      connections: How many links were opened so far.
    """

    def __init__(self, *, shared_memory: bool = True, segments: Segments = SHM) -> None:
        self.shared_memory = shared_memory
        self.segments = segments
        self.connections = 0
        self._listeners = ListenerTable("mem")

    async def listen(self, name: str) -> tuple[trio.abc.Listener[trio.abc.Stream], str]:
        await trio.lowlevel.checkpoint()
        return self._listeners.listen(name)

    async def connect(self, address: str) -> tuple[trio.abc.Stream, bool]:
        await trio.lowlevel.checkpoint()
        listener = self._listeners.at(address)
        ours, theirs = trio.testing.memory_stream_pair()
        listener.incoming.send_nowait(theirs)
        self.connections += 1
        return ours, self.shared_memory


@final
class ListenerTable:
    """The memory listeners of one network by address: what :class:`MemoryNetwork`
    and the simulator's network share of ``listen`` and ``connect``."""

    def __init__(self, scheme: str) -> None:
        self._scheme = scheme
        self._listeners: dict[str, MemoryListener] = {}

    def listen(
        self, name: str, on_close: Callable[[str], object] | None = None
    ) -> tuple[MemoryListener, str]:
        """A listener at ``<scheme>:<name>``, and that address; ``on_close(address)``
        when it closes."""
        address = f"{self._scheme}:{name}"
        if address in self._listeners:
            raise OSError(f"{address} is in use")

        def closed() -> None:
            self._listeners.pop(address, None)
            if on_close is not None:
                on_close(address)

        listener = self._listeners[address] = MemoryListener(closed)
        return listener, address

    def at(self, address: str) -> MemoryListener:
        """The listener at ``address``; ``ConnectionRefusedError`` if none."""
        listener = self._listeners.get(address)
        if listener is None:
            raise ConnectionRefusedError(f"nobody listens at {address!r}")
        return listener


@final
class MemoryListener(trio.abc.Listener[trio.abc.Stream]):
    def __init__(self, on_close: Callable[[], object]) -> None:
        self._on_close = on_close
        self.incoming, self._accepted = trio.open_memory_channel[trio.abc.Stream](math.inf)

    async def accept(self) -> trio.abc.Stream:
        try:
            return await self._accepted.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise trio.ClosedResourceError("the listener is closed") from None

    async def aclose(self) -> None:
        self._on_close()
        self.incoming.close()
        self._accepted.close()
        await trio.lowlevel.checkpoint()
