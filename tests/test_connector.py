"""The connector's relay, in-process over real socket pairs: routes, restarts of a
reading stage, and what it says was lost."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from omni_trio.process import _wire as wire
from omni_trio.process import open_shm_connector


class FakeWorker:
    """The worker's end of a connector connection."""

    def __init__(self) -> None:
        self.relay_end, mine = socket.socketpair()
        self.stream = trio.SocketStream(trio.socket.from_stdlib_socket(mine))
        self.reader = wire.FrameReader(self.stream, wire.DECODE_FROM_RELAY)

    async def send(self, *notices: wire.Chunk) -> None:
        await self.stream.send_all(b"".join(wire.encode(n) for n in notices))

    async def receive(self) -> list[object]:
        with trio.fail_after(5):
            return await self.reader.receive()


@pytest.fixture
async def workers():
    """Makes FakeWorkers; closes their ends of the connections afterwards."""
    made: list[FakeWorker] = []

    def make() -> FakeWorker:
        made.append(FakeWorker())
        return made[-1]

    yield make
    for worker in made:
        await worker.stream.aclose()
        if worker.relay_end.fileno() != -1:  # never attached: the relay did not take it
            worker.relay_end.close()


def attached(connector, workers) -> tuple[FakeWorker, FakeWorker]:
    """Stage 0's worker and stage 1's, both attached to the relay."""
    upstream, reader = workers(), workers()
    connector.attach(0, upstream.relay_end)
    connector.attach(1, reader.relay_end)
    return upstream, reader


def chunk(request_id: str, seq: int) -> wire.Chunk:
    return wire.Chunk(request_id, f"seg-{request_id}-{seq}", 10, seq)


async def test_notices_wait_for_a_restarting_reader_and_its_losses_are_named(workers):
    async with open_shm_connector({0: [1]}) as connector:
        upstream, reader = attached(connector, workers)
        await upstream.send(chunk("a", 0))
        assert await reader.receive() == [chunk("a", 0)]
        connector.released(1, "gone-already")

        # The reader's worker dies: "a" had been handed to it, so "a" is lost.
        assert connector.detach(1) == {"a"}
        await upstream.send(chunk("a", 1), chunk("b", 0))
        await trio.testing.wait_all_tasks_blocked()
        assert connector.statistics().notices_waiting == 2  # nothing dropped meanwhile

        replacement = workers()
        connector.attach(1, replacement.relay_end)
        assert await replacement.receive() == [chunk("a", 1), chunk("b", 0)]
        connector.released(1, "a")
        assert connector.detach(1) == {"b"}  # "a" was released: nothing of it is lost

        stats = connector.statistics()
        assert (stats.chunks_relayed, stats.bytes_relayed, stats.notices_waiting) == (3, 30, 0)


async def test_readers_hear_of_requests_that_died_with_their_upstream_worker(workers):
    async with open_shm_connector({0: [1]}) as connector:
        reader = workers()
        connector.attach(1, reader.relay_end)
        connector.lost(0, ["a", "b"], "stage 0 lost its worker")
        assert await reader.receive() == [
            wire.Lost("a", "stage 0 lost its worker"),
            wire.Lost("b", "stage 0 lost its worker"),
        ]
        assert connector.statistics().lost_notices == 2


async def test_a_reader_gone_for_good_gets_nothing_more(workers):
    async with open_shm_connector({0: [1]}) as connector:
        upstream = workers()
        connector.attach(0, upstream.relay_end)
        connector.close(1)
        await upstream.send(chunk("a", 0))
        await trio.testing.wait_all_tasks_blocked()
        stats = connector.statistics()
        assert (stats.chunks_relayed, stats.notices_waiting) == (0, 0)


async def test_a_request_that_ended_leaves_nothing_held_for_it(workers):
    """Released at its source, a request is over for its readers too -- even one it was
    never submitted to (a text-only request's talker gets chunks, but no release)."""
    async with open_shm_connector({0: [1]}) as connector:
        upstream, reader = attached(connector, workers)
        await upstream.send(chunk("text-only", 0))
        assert await reader.receive() == [chunk("text-only", 0)]
        connector.detach(1)  # the reader restarts ...
        await upstream.send(chunk("text-only", 1), chunk("other", 0))
        await trio.testing.wait_all_tasks_blocked()
        connector.released(0, "text-only")  # ... and the request ends meanwhile
        assert connector.statistics().notices_waiting == 1  # only "other"'s
        replacement = workers()
        connector.attach(1, replacement.relay_end)
        assert await replacement.receive() == [chunk("other", 0)]
        assert connector.detach(1) == {"other"}
