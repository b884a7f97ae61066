"""A simulated pipeline's workers and the network between them.

Every worker is the real worker (:func:`~omni_trio.process.worker._worker.serve`)
run as a task of the simulation's Trio run, like an in-process stage's -- but its
control connection and its chunk links are :class:`~._streams.Wire`\\ s, bounded
like sockets, and its rings live in :class:`~omni_trio.process.worker._shm.MemorySegments`.
So the simulation knows each worker's connections, and a fault can stall a worker
(hold all of them), break or delay its links, or kill it, from outside its code.
"""

from __future__ import annotations

import functools
from typing import Any

import trio

from .._util import final
from ..process._launcher import LaunchedWorker
from ..process._task_launcher import TaskHandle
from ..process.testing import ListenerTable
from ..process.worker._shm import MemorySegments, Segments
from ..process.worker._threads import IN_SIMULATION
from ._streams import Wire, open_wire

__all__ = ["SimLauncher", "SimNetwork"]

#: A worker's place: (stage id, replica).
Place = tuple[int, int]


@final
class _WorkerTransport:
    """One worker's way to its peers: links it opens are known as its."""

    def __init__(self, network: SimNetwork, place: Place) -> None:
        self._network = network
        self._place = place
        self.segments: Segments = network.segments

    async def listen(self, name: str) -> tuple[trio.abc.Listener[trio.abc.Stream], str]:
        await trio.lowlevel.checkpoint()
        places = self._network.places
        listener, address = self._network.listeners.listen(
            name, lambda address: places.pop(address, None)
        )
        places[address] = self._place
        return listener, address

    async def connect(self, address: str) -> tuple[trio.abc.Stream, bool]:
        await trio.lowlevel.checkpoint()
        listener = self._network.listeners.at(address)
        wire, ours, theirs = open_wire()
        self._network.add_link(self._place, self._network.places[address], wire)
        listener.incoming.send_nowait(theirs)
        return ours, True


@final
class _Link:
    __slots__ = ("source", "target", "wire")

    def __init__(self, source: Place, target: Place, wire: Wire) -> None:
        self.source = source
        self.target = target
        self.wire = wire


@final
class SimNetwork:
    """Every wire of one simulated pipeline: control connections and chunk links.

    Attributes:
      segments: Where its workers' rings live.
      links_opened: Chunk links opened so far.
    """

    def __init__(self) -> None:
        self.segments = MemorySegments()
        self.listeners = ListenerTable("sim")
        self.places: dict[str, Place] = {}  # whose worker listens at each address
        self._links: list[_Link] = []
        self._controls: list[Wire] = []
        self.workers: dict[Place, _SimWorker] = {}  # the current worker of each place
        self.links_opened = 0
        self._delays: dict[Place, float] = {}  # a sender's links' delay, while it lasts

    def transport(self, place: Place) -> _WorkerTransport:
        return _WorkerTransport(self, place)

    def add_link(self, source: Place, target: Place, wire: Wire) -> None:
        self._links = [link for link in self._links if link.wire.open]
        self._links.append(_Link(source, target, wire))
        self.links_opened += 1
        delay = self._delays.get(source)
        if delay:
            wire.set_delay(delay)
        worker = self.workers.get(source)
        if worker is not None and worker.stalled:
            wire.hold()
            worker.held.append(wire)

    def add_control(self, wire: Wire) -> None:
        self._controls = [control for control in self._controls if control.open]
        self._controls.append(wire)

    def links_of(self, place: Place) -> list[Wire]:
        """The open chunk links ``place``'s workers send on or read from."""
        return [
            link.wire
            for link in self._links
            if link.wire.open and place in (link.source, link.target)
        ]

    def links_from(self, place: Place) -> list[Wire]:
        return [link.wire for link in self._links if link.wire.open and link.source == place]

    def open_wires(self) -> int:
        """Wires (links and control connections) with an end still open."""
        return sum(link.wire.open for link in self._links) + sum(
            control.open for control in self._controls
        )

    def buffer_high_water(self) -> int:
        """The most bytes any pipe ever buffered."""
        wires = [link.wire for link in self._links] + self._controls
        return max((pipe.high_water for wire in wires for pipe in wire.pipes), default=0)

    # -- faults -------------------------------------------------------------------------

    def break_links(self, place: Place) -> int:
        """Break every link ``place``'s worker sends on; how many."""
        wires = self.links_from(place)
        for wire in wires:
            wire.break_()
        return len(wires)

    async def delay_links(self, place: Place, delay: float, duration: float) -> None:
        """Delay what ``place``'s worker sends on its links (those it opens meanwhile
        too) by ``delay`` seconds, for ``duration`` seconds."""
        self._delays[place] = delay
        for wire in self.links_from(place):
            wire.set_delay(delay)
        try:
            await trio.sleep(duration)
        finally:
            self._delays.pop(place, None)
            for wire in self.links_from(place):
                wire.set_delay(0.0)

    async def stall(self, place: Place, duration: float) -> bool:
        """Freeze ``place``'s current worker's connections for ``duration`` seconds
        (a stopped process: nothing in, nothing out); whether it had one."""
        worker = self.workers.get(place)
        if worker is None or worker.stalled:
            await trio.lowlevel.checkpoint()
            return False
        worker.stalled = True
        worker.held = [worker.control, *self.links_of(place)]
        for wire in worker.held:
            wire.hold()
        try:
            await trio.sleep(duration)
        finally:
            worker.stalled = False
            for wire in worker.held:
                wire.release()
            worker.held = []
        return True


@final
class _SimWorker(TaskHandle):
    """A worker's task, as a launcher's handle: an in-process worker's, whose
    engines know they run in a simulation, with its wires known for faults."""

    def __init__(self, control: Wire) -> None:
        super().__init__()
        self.control = control
        self.stalled = False
        self.held: list[Wire] = []

    async def run(self, *args: Any, **kwargs: Any) -> None:
        IN_SIMULATION.set(True)  # this task's context: its engines see it
        await super().run(*args, **kwargs)


@final
class SimLauncher:
    """Launches the workers of one replica of one stage as simulated workers."""

    backend = "inprocess"

    def __init__(self, network: SimNetwork, place: Place) -> None:
        self._network = network
        self._place = place

    async def launch(self, nursery: trio.Nursery, *, name: str) -> LaunchedWorker:
        await trio.lowlevel.checkpoint()  # never after the task is started
        wire, ours, theirs = open_wire()
        self._network.add_control(wire)
        worker = _SimWorker(wire)
        self._network.workers[self._place] = worker
        stage_id, replica = self._place
        run = functools.partial(worker.run, transport=self._network.transport(self._place))
        nursery.start_soon(run, theirs, name=f"simulated worker {stage_id}.{replica}")
        return LaunchedWorker(worker, ours, heartbeat=True)
