"""The control plane's framing: whole frames, validated, or a clear error."""

from __future__ import annotations

import struct

import pytest
import trio
import trio.testing

from omni_trio.process.worker._framing import FrameReader, FrameWriter
from omni_trio.process.worker._wire import (
    DECODE_FROM_WORKER,
    DECODE_TO_WORKER,
    FrameBuffer,
    Output,
    Pong,
    ProtocolError,
    Submit,
    encode,
)


def reader_over(*chunks: bytes, max_frame: int = 1 << 20) -> FrameReader:
    stream = trio.testing.MemoryReceiveStream()
    for chunk in chunks:
        stream.put_data(chunk)
    stream.put_eof()
    return FrameReader(stream, DECODE_FROM_WORKER, max_frame=max_frame)


async def test_frames_round_trip_and_arrive_in_batches():
    frames = encode(Output("r", b"\x00pcm", False)) + encode(Output("r", None, True))
    reader = reader_over(frames + encode(Pong(7)))
    assert await reader.receive() == [
        Output("r", b"\x00pcm", False),
        Output("r", None, True),
        Pong(7),
    ]
    with pytest.raises(EOFError):
        await reader.receive()


async def test_a_frame_split_across_reads_is_reassembled():
    frame = encode(Output("r", "x" * 1000, False))
    reader = reader_over(frame[:3], frame[3:500], frame[500:])
    assert await reader.receive() == [Output("r", "x" * 1000, False)]


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "malformed frame"),
        (struct.pack(">I", 2) + b"\x92\x01", "malformed frame"),  # [1, ?]: no such message
        (encode(Submit("r", 1)), "malformed frame"),  # valid, but the wrong direction
        (encode(Output("r", 1, False))[:-1], "closed in the middle of a frame"),
        (struct.pack(">I", 2**31), "over the 1048576-byte limit"),
    ],
    ids=["garbage", "unknown-tag", "wrong-direction", "truncated", "oversized"],
)
async def test_a_bad_frame_is_a_protocol_error(wire, message):
    with pytest.raises(ProtocolError, match=message):
        await reader_over(wire).receive()


async def test_an_oversized_frame_is_refused_before_it_is_buffered():
    stream = trio.testing.MemoryReceiveStream()
    stream.put_data(struct.pack(">I", 10**9))  # and nothing else: no wait for the body
    with pytest.raises(ProtocolError, match="announced 1000000000 bytes"):
        await FrameReader(stream, DECODE_TO_WORKER).receive()


def test_unencodable_data_is_a_type_error():
    with pytest.raises(TypeError):
        encode(Output("r", object(), False))


async def test_the_writer_sends_queued_frames_in_one_write():
    writes = []
    stream = trio.testing.MemorySendStream()

    async def count_writes():
        writes.append(stream.get_data_nowait())

    stream.send_all_hook = count_writes
    writer = FrameWriter(stream)
    for i in range(3):
        writer.send_nowait(encode(Pong(i)))
    writer.close()
    await writer.run()
    assert len(writes) == 1
    assert await reader_over(*writes).receive() == [Pong(0), Pong(1), Pong(2)]


async def test_a_producer_waits_while_more_than_high_water_is_queued():
    """``send`` queues at once below the mark, and waits above it until the writer
    has written enough; ``flushed`` waits until what was queued is written."""
    stream = trio.testing.MemorySendStream()
    writer = FrameWriter(stream, high_water=100)
    frame = encode(Output("r", "x" * 60, False))
    queued = []

    async def produce():
        for _ in range(4):
            await writer.send(frame)
            queued.append(writer.queued)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        await trio.testing.wait_all_tasks_blocked()
        assert len(queued) == 2  # over 100 bytes queued: the third waits
        flushed = trio.Event()

        async def flush():
            await writer.flushed()
            flushed.set()

        nursery.start_soon(flush)
        await trio.testing.wait_all_tasks_blocked()
        assert not flushed.is_set()
        nursery.start_soon(writer.run)
        await trio.testing.wait_all_tasks_blocked()
        assert flushed.is_set()
        assert len(queued) == 4
        writer.close()
    frames = await reader_over(stream.get_data_nowait()).receive()
    assert frames == [Output("r", "x" * 60, False)] * 4


async def test_nobody_waits_on_a_writer_whose_connection_is_gone():
    """Its peer went away: a producer is not held back by frames nobody will write."""
    stream = trio.testing.MemorySendStream()

    async def broken():
        raise trio.BrokenResourceError

    stream.send_all_hook = broken
    writer = FrameWriter(stream, high_water=10)
    writer.send_nowait(encode(Pong(1)))
    with pytest.raises(trio.BrokenResourceError):
        await writer.run()
    with trio.fail_after(1):
        await writer.send(encode(Pong(2)))  # over the mark, and no wait
        await writer.flushed()


def test_the_frame_buffer_gives_whole_frames_only_without_io():
    """The sans-IO half: bytes in, whole frames out, a cut-off frame kept until the
    rest of it comes (the reader above is this buffer fed by a stream)."""
    frames = encode(Output("r", b"pcm", False)) + encode(Pong(3))
    buffer = FrameBuffer(DECODE_FROM_WORKER)
    taken = []
    for i in range(len(frames)):
        buffer.feed(frames[i : i + 1])
        taken += buffer.frames()
        if i < len(frames) - 1:
            assert len(taken) < 2
    assert taken == [Output("r", b"pcm", False), Pong(3)]
    assert len(buffer) == 0
    buffer.feed(encode(Pong(4))[:-1])
    assert buffer.frames() == []
    assert len(buffer) == len(encode(Pong(4))) - 1
    small = FrameBuffer(DECODE_FROM_WORKER, max_frame=4)
    small.feed(encode(Output("r", b"x" * 10, False)))
    with pytest.raises(ProtocolError, match="over the 4-byte limit"):
        small.frames()
