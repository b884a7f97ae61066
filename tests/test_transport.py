"""The worker's seam to the network: two workers serve over in-memory streams, with
no socket anywhere, and stream to each other through a ``MemoryNetwork`` -- small
chunks inline, big ones through the sender's shared-memory ring."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from omni_trio.process.testing import MemoryNetwork
from omni_trio.process.worker import _shm
from omni_trio.process.worker import _wire as wire
from omni_trio.process.worker._framing import FrameReader, FrameWriter, write_until_closed
from omni_trio.process.worker._worker import serve

SIZES = [10, 100_000, 20, 300_000]  # inline, ring, inline, ring


def sender(**_):
    async def engine(request, io):
        for seq, size in enumerate(SIZES):
            await io.send(bytes([seq]) * size)
        yield "sent"

    return engine


def reader(**_):
    async def engine(request, io):
        async for chunk in io:
            yield (len(chunk), chunk[:1])

    return engine


class Control:
    """The orchestrator's end of a worker's control connection."""

    def __init__(self, stream: trio.abc.Stream, nursery: trio.Nursery) -> None:
        self.reader = FrameReader(stream, wire.DECODE_FROM_WORKER)
        self.writer = FrameWriter(stream)
        self.frames: list[object] = []
        nursery.start_soon(write_until_closed, self.writer)

    def send(self, message: object) -> None:
        self.writer.send_nowait(wire.encode(message))

    async def until(self, kind: type, count: int = 1) -> list[object]:
        while sum(type(f) is kind for f in self.frames) < count:
            self.frames += await self.reader.receive()
        return [f for f in self.frames if type(f) is kind]


@pytest.mark.parametrize("shared_memory", [True, False])
async def test_two_workers_stream_to_each_other_over_memory(shared_memory):
    network = MemoryNetwork(shared_memory=shared_memory)
    prefix = _shm.new_prefix()
    common = {"prefix": prefix, "chunks": True, "inline_chunk_bytes": 1024}
    common["ring_bytes"] = 1 << 20
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            controls = []
            for factory in (sender, reader):
                ours, theirs = trio.testing.memory_stream_pair()
                nursery.start_soon(
                    lambda s=theirs, f=factory: serve(s, factory=f, transport=network)
                )
                controls.append(Control(ours, nursery))
            up, down = controls
            up.send(wire.Init(0, "up", "test:sender", {}, targets=[1], **common))
            down.send(wire.Init(1, "down", "test:reader", {}, listen=True, **common))
            (ready,) = await down.until(wire.Ready)
            assert ready.address == f"mem:{prefix}-1-1"
            await up.until(wire.Ready)
            up.send(wire.Route(1, ready.address))
            up.send(wire.Submit("r", "go", life=1))
            down.send(wire.Submit("r", None, life=1))
            done = await down.until(wire.Output, len(SIZES) + 1)
            assert [(o.data, o.finished) for o in done] == [
                *(([size, bytes([seq])], False) for seq, size in enumerate(SIZES)),
                (None, True),
            ]
            assert [o.data for o in await up.until(wire.Output, 2)] == ["sent", None]
            rings = _shm.listing(prefix)
            assert len(rings) == (1 if shared_memory else 0)  # big chunks: the ring
            for control in controls:
                control.send(wire.Shutdown())
                control.writer.close()  # its task ends once the Shutdown is written
        assert network.connections == 1
        assert _shm.listing(prefix) == []  # the sender closed (and unlinked) its ring


async def test_connecting_where_nobody_listens_is_an_os_error():
    network = MemoryNetwork()
    listener, address = await network.listen("w")
    await listener.aclose()
    with pytest.raises(OSError, match="nobody listens"):
        await network.connect(address)
    with pytest.raises(trio.ClosedResourceError):
        await listener.accept()
