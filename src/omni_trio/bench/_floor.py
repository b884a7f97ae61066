"""The floors of the process scenarios: two processes and a raw Trio socket pair.

What the process data plane is measured against, in the same run: a sender and a
receiver process (``python -m omni_trio.bench._floor send|receive``) connected by an
inherited socket pair, both ends on :class:`trio.SocketStream`, with the wire's
framing (a 4-byte big-endian length, then a msgspec-msgpack body) and nothing else:
no relay, no orchestrator, one ``send_all`` per frame. A chunk travels as
``["floor", seq, chunk]``, built as the bench's engines build theirs
(:func:`~omni_trio.bench._chunk_engines.stamped`), and is taken as arrived once it is
decoded (copied out of the receive buffer).

With a shared-memory area (``--shm``), the chunk goes through it instead: the sender
copies it into one of ``--window`` pre-mapped slots and sends ``["floor", seq, slot,
size]``; the receiver copies it out into ``bytes`` and hands the slot back (a frame
with its number). That is the least any shared-memory data plane does per chunk.

A run is a list of phases, ``(name, count, interval)``: before each (and once after
the last), the receiver says it is ready (a frame ``-1``) and the sender then sends
``count`` chunks, ``interval`` seconds apart (back to back with 0). The receiver
prints, as JSON, one result per phase: the first chunk's stamp, the last chunk's
arrival, and each chunk's hop (ns, on the system-wide monotonic clock).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import trio

from ._chunk_engines import STAMP, stamped

__all__ = ["Phase", "floor_chunks", "floor_outputs", "main"]

Phase = tuple[str, int, float]
"""``(name, count, interval)``: ``count`` chunks, ``interval`` seconds apart."""

_HEADER = struct.Struct(">I")
_ENCODER = msgspec.msgpack.Encoder()
#: sender -> receiver: ``[request id, seq, chunk]``, or ``[request id, seq, slot, size]``.
_CHUNK = msgspec.msgpack.Decoder(tuple[str, int, bytes])
_NOTICE = msgspec.msgpack.Decoder(tuple[str, int, int, int])
#: receiver -> sender: ``-1`` (ready for the next phase) or a slot handed back.
_CREDIT = msgspec.msgpack.Decoder(int)
_READY = -1
_SHM_DIR = "/dev/shm"


class _Frames:
    """Framed msgpack over a stream: one ``send_all`` per frame sent; every
    complete frame received at once."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._received = bytearray()
        self._sending = bytearray()

    async def send(self, message: Any) -> None:
        out = self._sending
        _ENCODER.encode_into(message, out, _HEADER.size)
        _HEADER.pack_into(out, 0, len(out) - _HEADER.size)
        await self._stream.send_all(out)

    async def receive(self, decoder: msgspec.msgpack.Decoder[Any]) -> list[Any]:
        buffer = self._received
        while True:
            frames, need = [], _HEADER.size
            offset = 0
            while len(buffer) - offset >= _HEADER.size:
                (length,) = _HEADER.unpack_from(buffer, offset)
                end = offset + _HEADER.size + length
                if len(buffer) < end:
                    need = end - len(buffer)
                    break
                frames.append(decoder.decode(memoryview(buffer)[offset + _HEADER.size : end]))
                offset = end
            if offset:
                del buffer[:offset]
            if frames:
                return frames
            data = await self._stream.receive_some(max(need, 1 << 16))
            if not data:
                raise EOFError("the other floor process closed the connection")
            buffer += data


async def _wait_until_ready(frames: _Frames) -> None:
    while _READY not in await frames.receive(_CREDIT):  # slots handed back are dropped
        pass


async def _send(
    frames: _Frames, size: int, phases: Sequence[Phase], area: mmap.mmap | None, window: int
) -> None:
    padding = bytes(size - STAMP.size)
    for _name, count, interval in phases:
        await _wait_until_ready(frames)
        free = list(range(window))
        for seq in range(count):
            if area is None:
                await frames.send(("floor", seq, stamped(padding)))
            else:
                while not free:
                    free += await frames.receive(_CREDIT)
                slot = free.pop()
                area[slot * size : (slot + 1) * size] = stamped(padding)
                await frames.send(("floor", seq, slot, size))
            if interval:
                await trio.sleep(interval)
    await _wait_until_ready(frames)  # the receiver has everything: it sends nothing more


async def _receive(
    frames: _Frames, phases: Sequence[Phase], area: mmap.mmap | None
) -> list[dict[str, Any]]:
    results = []
    for name, count, _interval in phases:
        await frames.send(_READY)
        hops: list[int] = []
        first = arrived = None
        while len(hops) < count:
            if area is None:
                for _rid, _seq, chunk in await frames.receive(_CHUNK):
                    arrived = time.monotonic_ns()
                    (stamp,) = STAMP.unpack_from(chunk)
                    hops.append(arrived - stamp)
                    first = stamp if first is None else first
            else:
                for _rid, _seq, slot, size in await frames.receive(_NOTICE):
                    chunk = area[slot * size : (slot + 1) * size]  # copied out
                    arrived = time.monotonic_ns()
                    await frames.send(slot)
                    (stamp,) = STAMP.unpack_from(chunk)
                    hops.append(arrived - stamp)
                    first = stamp if first is None else first
        results.append({"name": name, "first": first, "end": arrived, "count": count, "hops": hops})
    await frames.send(_READY)  # the sender may go
    return results


def _stream(sock: socket.socket) -> trio.SocketStream:
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


# -- this process's side: spawning the floors -----------------------------------------------


def _command(
    role: str, fd: int, size: int, phases: Sequence[Phase], area: str | None, window: int
) -> list[str]:
    command = [sys.executable, "-m", "omni_trio.bench._floor", role, "--fd", str(fd)]
    command += ["--size", str(size), "--window", str(window)]
    for name, count, interval in phases:
        command += ["--phase", f"{name}:{count}:{interval!r}"]
    if area is not None:
        command += ["--shm", area]
    return command


async def _spawn(command: list[str], keep: socket.socket, *, output: bool) -> trio.Process:
    env = dict(os.environ)  # the floor imports what this process can
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return await trio.lowlevel.open_process(
        command,
        pass_fds=[keep.fileno()],
        env=env,
        stdout=subprocess.PIPE if output else None,
    )


async def _finish(process: trio.Process, what: str) -> bytes:
    """Read the process's output to its end and wait for it; raise if it failed."""
    out = bytearray()
    if process.stdout is not None:
        while chunk := await process.stdout.receive_some():
            out += chunk
    code = await process.wait()
    if code:
        raise RuntimeError(f"the {what} floor process exited with status {code}")
    return bytes(out)


async def _reap(processes: list[trio.Process]) -> None:
    for process in processes:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()


async def floor_chunks(
    size: int, phases: Sequence[Phase], *, window: int = 0
) -> list[dict[str, Any]]:
    """Run ``phases`` of ``size``-byte chunks between two new processes: over the
    socket pair, or through a shared-memory area of ``window`` slots (``window > 0``).
    Returns the receiver's results, one per phase."""
    area = None
    if window:
        area = os.path.join(_SHM_DIR, f"otfloor{os.getpid():x}{secrets.token_hex(3)}")
        fd = os.open(area, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, window * size)
        finally:
            os.close(fd)
    sending, receiving = socket.socketpair()
    processes: list[trio.Process] = []
    try:
        for role, sock in (("receive", receiving), ("send", sending)):
            command = _command(role, sock.fileno(), size, phases, area, max(window, 1))
            processes.append(await _spawn(command, sock, output=role == "receive"))
            sock.close()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_finish, processes[1], "sending")
            results: list[dict[str, Any]] = json.loads(await _finish(processes[0], "receiving"))
        return results
    finally:
        sending.close()
        receiving.close()
        await _reap(processes)
        if area is not None:
            os.unlink(area)


async def floor_outputs(phases: Sequence[Phase]) -> list[dict[str, Any]]:
    """Run ``phases`` of small frames (an 8-byte chunk: the stamp) from a new process
    to this one, as a worker's outputs reach the orchestrator. Returns this end's
    results, one per phase."""
    sending, receiving = socket.socketpair()
    processes: list[trio.Process] = []
    try:
        processes.append(
            await _spawn(
                _command("send", sending.fileno(), STAMP.size, phases, None, 1),
                sending,
                output=False,
            )
        )
        sending.close()
        async with _stream(receiving) as stream:
            results = await _receive(_Frames(stream), phases, None)
        await _finish(processes[0], "sending")
        return results
    finally:
        sending.close()
        receiving.close()
        await _reap(processes)


# -- the floor processes ---------------------------------------------------------------------


def _phase(text: str) -> Phase:
    name, count, interval = text.split(":")
    return name, int(count), float(interval)


async def _run(args: argparse.Namespace) -> None:
    area = _map(args.shm) if args.shm else None
    async with _stream(socket.socket(fileno=args.fd)) as stream:
        frames = _Frames(stream)
        if args.role == "send":
            await _send(frames, args.size, args.phase, area, args.window)
        else:
            print(json.dumps(await _receive(frames, args.phase, area)))
    if area is not None:
        area.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench._floor")
    parser.add_argument("role", choices=["send", "receive"])
    parser.add_argument("--fd", type=int, required=True, help="this end of the socket pair")
    parser.add_argument("--size", type=int, required=True, help="bytes per chunk (>= 8)")
    parser.add_argument(
        "--phase", type=_phase, action="append", required=True, help="name:count:interval"
    )
    parser.add_argument("--shm", help="the shared-memory area's path: chunks go through it")
    parser.add_argument("--window", type=int, default=1, help="slots of the area")
    trio.run(_run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
