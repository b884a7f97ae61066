"""The control plane's framing: whole frames, validated, or a clear error."""

from __future__ import annotations

import struct

import pytest
import trio
import trio.testing

from omni_trio.process._wire import (
    DECODE_FROM_WORKER,
    DECODE_TO_WORKER,
    FrameReader,
    FrameWriter,
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
