"""Experiment: what a chunk costs through the shared-memory ring (``process.worker._ring``),
next to plain copies and to a segment of its own per chunk (what the connector did
before the ring: ``multiprocessing.shared_memory``, untracked).

For each ``--sizes`` it times, per chunk, in one process (the reader maps the ring a
second time, as a reading worker would): ``bytes(data)`` once and twice (the ring
copies twice: into the slot, out of it), the ring's allocate + write + read + free
for one chunk at a time (always the same slot: warm caches) and with the ring kept
full (a chunk is read and freed when the ring has no room for the next: slots cycle
through the whole ring, as a reader that lags does), and a segment's create + read +
unlink. Median of ``--repeat`` runs of ``--count``
chunks each; then what creating and opening a ring of ``--ring`` bytes costs once.

Run: PYTHONPATH=src python tools/bench_ring.py [--sizes 1048576,49152] [--ring 67108864]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

from omni_trio.process.worker import _ring, _shm


def _segment(name: str, *, create: bool, size: int = 0) -> shared_memory.SharedMemory:
    """A segment the resource tracker does not watch (as the old connector made them)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, create=create, size=size, track=False)
    segment = shared_memory.SharedMemory(name, create=create, size=size)
    # the tracker knows a POSIX segment by its name with a leading slash
    resource_tracker.unregister(f"/{segment.name}", "shared_memory")
    return segment


def per_chunk_us(step: Callable[[int], object], count: int, repeat: int) -> float:
    """The median over ``repeat`` runs of ``count`` calls of ``step(i)``, per call, in µs."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for i in range(count):
            step(i)
        runs.append((time.perf_counter_ns() - start) / count / 1000)
    return statistics.median(runs)


def bench_size(prefix: str, size: int, ring_bytes: int, count: int, repeat: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    view = memoryview(data)  # bytes(data) would be data itself, no copy
    writer = _ring.RingWriter.create(f"{prefix}-bench", ring_bytes)
    reader = _ring.RingReader.open(writer.name)

    def through_ring(i: int) -> None:
        offset = writer.allocate(size)
        assert offset is not None  # one chunk at a time: the ring is never full
        writer.write(offset, i, data)
        reader.read(offset, i, size)
        writer.free(offset)

    def twice(i: int) -> None:
        # One after the other: a copy of a copy would hold two big blocks at once, and
        # glibc then hands one back to the kernel each time (page faults: 0.75 ms per MiB).
        bytes(view)
        bytes(view)

    window: deque[tuple[int, int]] = deque()  # (offset, tag), oldest first

    def cycling(i: int) -> None:
        while (offset := writer.allocate(size)) is None:
            old, tag = window.popleft()
            reader.read(old, tag, size)
            writer.free(old)
        writer.write(offset, i, data)
        window.append((offset, i))

    def through_segment(i: int) -> None:
        name = f"{prefix}-seg-{i}"
        segment = _segment(name, create=True, size=size)
        segment.buf[:size] = view  # type: ignore[index]
        segment.close()
        segment = _segment(name, create=False)
        bytes(segment.buf[:size])  # type: ignore[index]
        segment.close()
        os.unlink(os.path.join(_shm.SHM_DIR, name))

    try:
        results = {
            "1 copy: bytes(data)": per_chunk_us(lambda i: bytes(view), count, repeat),
            "2 copies": per_chunk_us(twice, count, repeat),
            "ring, one slot": per_chunk_us(through_ring, count, repeat),
            "ring, cycling": per_chunk_us(cycling, count, repeat),
            "segment per chunk": per_chunk_us(through_segment, count, repeat),
        }
    finally:
        view.release()
        reader.close()
        writer.close()
    for what, us in results.items():
        print(f"{size:>9} B  {what:<20} {us:9.1f} µs")


def bench_setup(prefix: str, ring_bytes: int, repeat: int) -> None:
    creates, opens = [], []
    for i in range(repeat):
        start = time.perf_counter_ns()
        writer = _ring.RingWriter.create(f"{prefix}-setup-{i}", ring_bytes)
        middle = time.perf_counter_ns()
        reader = _ring.RingReader.open(writer.name)
        creates.append((middle - start) / 1e6)
        opens.append((time.perf_counter_ns() - middle) / 1e6)
        reader.close()
        writer.close()
    print(
        f"ring of {ring_bytes} B: create {statistics.median(creates):.2f} ms, "
        f"open {statistics.median(opens):.2f} ms (median of {repeat})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1048576,49152", help="chunk sizes, comma-separated")
    parser.add_argument("--ring", type=int, default=64 * 1024 * 1024, help="ring size (bytes)")
    parser.add_argument("--count", type=int, default=500, help="chunks per run")
    parser.add_argument("--repeat", type=int, default=7, help="runs; the median counts")
    args = parser.parse_args()
    prefix = _shm.new_prefix()
    try:
        for size in map(int, args.sizes.split(",")):
            bench_size(prefix, size, args.ring, args.count, args.repeat)
        bench_setup(prefix, args.ring, args.repeat)
    finally:
        _shm.sweep(prefix)


if __name__ == "__main__":
    main()
