"""Experiment behind docs/performance.md: what one chunk costs between two worker processes.

Stage 0 (a worker process) streams chunks of ``--size`` bytes to stage 1 (another)
through the shm connector's relay in this process: first ``--count`` chunks back to
back (chunks/s, and CPU per chunk: both workers' and the relay's), then ``--paced``
chunks one every ``--interval`` seconds (the hop's latency: from the sender's
``io.send`` to the reader's ``async for``, on the system-wide monotonic clock). It
uses only the public API, so the same file measures any version of the package:
``PYTHONPATH=src python tools/bench_chunks.py``.

Run: python tools/bench_chunks.py [--size 4096] [--inline-chunk-bytes N]
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time
from typing import Any

import trio

from omni_trio.process import Last, open_process_stage, open_shm_connector

_STAMP = struct.Struct(">q")  # the sender's time.monotonic_ns(), first in each chunk


def sender(size: int, count: int, interval: float = 0.0) -> Any:
    """Sends ``count`` stamped chunks of ``size`` bytes; completes with its CPU time."""
    padding = bytes(size - _STAMP.size)

    async def engine(request: Any, io: Any) -> Any:
        cpu = time.process_time()
        for _ in range(count):
            await io.send(_STAMP.pack(time.monotonic_ns()) + padding)
            if interval:
                await trio.sleep(interval)
        yield Last({"cpu": time.process_time() - cpu})

    return engine


def reader() -> Any:
    """Reads every chunk; completes with each chunk's hop latency, its CPU time, and
    the time of the last chunk."""

    async def engine(request: Any, io: Any) -> Any:
        cpu = time.process_time()
        hops = []
        async for chunk in io:
            hops.append(time.monotonic_ns() - _STAMP.unpack_from(chunk)[0])
        end = time.monotonic_ns()
        yield Last({"cpu": time.process_time() - cpu, "hops": hops, "end": end})

    return engine


async def _completion(stage: Any) -> Any:
    while True:
        item = await stage.outputs.receive()
        for out in item if isinstance(item, list) else [item]:
            if out.finished:
                return out.data


async def run(args: argparse.Namespace, request_id: str, count: int, interval: float) -> Any:
    connector_args = {}
    if args.inline_chunk_bytes is not None:
        connector_args["inline_chunk_bytes"] = args.inline_chunk_bytes
    engine_args = {"size": args.size, "count": count, "interval": interval}
    async with (
        open_shm_connector({0: [1]}, **connector_args) as connector,
        open_process_stage(
            "bench_chunks:sender", engine_args=engine_args, connector=connector
        ) as sending,
        open_process_stage("bench_chunks:reader", stage_id=1, connector=connector) as reading,
    ):
        await reading.submit(request_id, None)
        relay_cpu = time.process_time()
        start = time.monotonic_ns()
        await sending.submit(request_id, None)
        sent, read = await _completion(sending), await _completion(reading)
        relay_cpu = time.process_time() - relay_cpu
    return {
        "seconds": (read["end"] - start) / 1e9,
        "cpu": sent["cpu"] + read["cpu"] + relay_cpu,
        "hops": read["hops"],
    }


async def main(args: argparse.Namespace) -> None:
    burst = await run(args, "burst", args.count, 0.0)
    paced = await run(args, "paced", args.paced, args.interval)
    hops = sorted(paced["hops"])
    p50 = statistics.median(hops) / 1e3
    p99 = hops[int(len(hops) * 0.99)] / 1e3
    print(
        f"{args.size} B chunks: {args.count / burst['seconds']:8.0f} chunks/s  "
        f"CPU {burst['cpu'] / args.count * 1e6:5.0f} us/chunk  "
        f"hop p50 {p50:5.0f} us  p99 {p99:5.0f} us"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="bytes per chunk (>= 8)")
    parser.add_argument("--count", type=int, default=20_000, help="chunks sent back to back")
    parser.add_argument("--paced", type=int, default=2_000, help="chunks sent one by one")
    parser.add_argument("--interval", type=float, default=0.001, help="seconds between those")
    parser.add_argument("--inline-chunk-bytes", type=int, help="the connector's threshold")
    trio.run(main, parser.parse_args())
