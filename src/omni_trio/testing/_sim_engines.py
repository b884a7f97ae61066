"""The simulation workload's engines: every item they make says which request it
belongs to, so a simulation can check that no request ever reads another's data.

Both pace themselves with ``trio.sleep`` alone, so in virtual time they cost no real
time. They are ordinary engines (see :data:`~omni_trio.process.Engine`): a pipeline
of real worker processes runs them as well.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio

from ..process import ChunkIO, Engine, EngineRequest

__all__ = ["expected_items", "join", "relay", "source"]


def expected_items(prompt: str, count: int, stage_id: int) -> list[str]:
    """What stage ``stage_id`` yields for ``prompt`` when nothing is lost."""
    items = [f"{prompt}:{i}" for i in range(count)]
    return items if stage_id == 0 else [item.upper() for item in items]


def source(count: int = 4, delay: float = 0.01) -> Engine:
    """Stage 0: yields ``<prompt>:<i>`` for i < ``count``, one every ``delay``
    seconds, and streams each downstream (async_chunk)."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        for i in range(count):
            await trio.sleep(delay)
            item = f"{request.inputs}:{i}"
            if io.connected:
                await io.send(item.encode())
            yield item

    return engine


def relay(delay: float = 0.0) -> Engine:
    """A later stage: yields each upstream chunk upper-cased and passes it on
    (async_chunk), or its forwarded inputs upper-cased (forward)."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        if io.connected:
            async for chunk in io:
                if delay:
                    await trio.sleep(delay)
                await io.send(chunk)
                yield bytes(chunk).decode().upper()
        else:
            for item in request.inputs:
                yield str(item).upper()

    return engine


def join() -> Engine:
    """A stage that reads several (a fan-in): yields each chunk of each, as they
    come, upper-cased and marked with the stage it came from, ``<ITEM>@<stage>``."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        async for stage_id, chunk in io.chunks():
            yield f"{bytes(chunk).decode().upper()}@{stage_id}"

    return engine
