"""The engines of the process scenarios, imported by the bench's worker processes.

Each request's input says what to do (``{"size": 4096, "count": 1000, "interval":
0.001}``), so one pipeline serves every phase and size. A chunk starts with its
sender's ``time.monotonic_ns()`` (the system-wide clock, so the receiving process can
subtract it), the rest is padding; the floors in :mod:`omni_trio.bench._floor` build
their chunks with the same :func:`stamped`.
"""

from __future__ import annotations

import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import trio

from ..process import ChunkIO, Engine, EngineRequest, Last

__all__ = [
    "STAMP",
    "chunk_joiner",
    "chunk_reader",
    "chunk_sender",
    "output_source",
    "same_input",
    "stamped",
]

#: The sender's ``time.monotonic_ns()``, first in each chunk.
STAMP = struct.Struct(">q")


def stamped(padding: bytes) -> bytes:
    """A chunk: the stamp of now, then ``padding``."""
    return STAMP.pack(time.monotonic_ns()) + padding


def same_input(prompt: Any) -> Any:
    """``prewarm_func``: the reader gets the sender's instructions (the prompt)."""
    return prompt


def chunk_sender() -> Engine:
    """Stage 0: sends ``count`` chunks of ``size`` bytes downstream, ``interval``
    seconds apart (back to back with 0); its completion is the count. With
    ``"start"`` (a ``time.monotonic()``, the system-wide clock), the ``i``-th chunk
    goes at ``start + offset + i * interval``, ``offset`` being this stage's in
    ``"offsets"`` (seconds, by stage id as a string; 0 if absent): senders to one
    join keep their phases, in step or apart. ``"counts"`` (by stage id as a
    string) overrides ``count`` for the stages it names."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        task = request.inputs
        padding = bytes(task["size"] - STAMP.size)
        interval = task["interval"]
        stage = str(request.stage_id)
        count = task.get("counts", {}).get(stage, task["count"])
        start = task.get("start")
        if start is not None and interval:
            start += task.get("offsets", {}).get(stage, 0.0)
            for i in range(count):
                await trio.sleep(max(0.0, start + i * interval - time.monotonic()))
                await io.send(stamped(padding))
            yield Last(count)
            return
        for _ in range(count):
            await io.send(stamped(padding))
            if interval:
                await trio.sleep(interval)
        yield Last(count)

    return engine


class _Tally:
    """What a reader completes with: the first chunk's stamp, the count, the hops
    (when kept) and the count per source."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.hops: list[int] = []
        self.per_source: dict[int, int] = {}
        self.first: int | None = None
        self.count = 0

    def add(self, chunk: bytes, source: int) -> None:
        arrived = time.monotonic_ns()
        (stamp,) = STAMP.unpack_from(chunk)
        if self.first is None:
            self.first = stamp
        if self.keep:
            self.hops.append(arrived - stamp)
        self.per_source[source] = self.per_source.get(source, 0) + 1
        self.count += 1

    def last(self) -> Last:
        found = {"first": self.first, "count": self.count, "hops": self.hops}
        return Last({**found, "sources": self.per_source})


def _keeps_hops(request: EngineRequest) -> bool:
    return bool(request.inputs and request.inputs.get("hops"))


def chunk_reader() -> Engine:
    """Stage 1: reads every chunk, yielding one small output (its count so far) per
    chunk; completes with the first chunk's stamp, the count, and -- when the input
    says ``"hops": true`` -- each chunk's hop (ns from its stamp to its arrival)."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        tally = _Tally(_keeps_hops(request))
        async for chunk in io:
            tally.add(chunk, 0)
            yield tally.count
        yield tally.last()

    return engine


def chunk_joiner() -> Engine:
    """:func:`chunk_reader` at a join: reads every source's chunks as they come
    (``io.chunks()``); completes with how many came from each source too."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        tally = _Tally(_keeps_hops(request))
        async for source, chunk in io.chunks():
            tally.add(chunk, source)
            yield tally.count
        yield tally.last()

    return engine


def output_source() -> Engine:
    """A lone stage: yields ``count`` outputs, each its own ``time.monotonic_ns()``,
    ``interval`` seconds apart (back to back with 0); the last as its completion."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        task = request.inputs
        count, interval = task["count"], task["interval"]
        for index in range(1, count + 1):
            stamp = time.monotonic_ns()
            yield Last(stamp) if index == count else stamp
            if interval:
                await trio.sleep(interval)

    return engine
