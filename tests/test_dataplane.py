"""Chunks between real worker processes: every size, inline and through the ring,
several requests at once; the windows and the ring that hold a sender back, and
what is reclaimed when a worker dies or a request is aborted.

Stage 0 runs ``process_engines:sends`` (its outputs are its progress: how many
chunks it has sent), stage 1 ``process_engines:reads`` (an output per chunk: its
size if it came whole and in its place); a request whose id starts with ``held``
is not read until the test creates the gate file. Both stages are final, so the
test sees both. ``running`` checks that nothing is left afterwards: no segment, no
worker process, no resource tracker; the suite's fixture checks /dev/shm again.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import trio

from omni_trio.process._options import MIN_RING_BYTES, RING_BYTES
from omni_trio.process.worker import _shm
from processes import eventually, pipeline_config, running

#: What these tests hold to account is mostly the shared-memory rings; a Ray stage's
#: chunks travel inline over TCP (tests/test_ray.py sends every size between nodes).
pytestmark = pytest.mark.process_specific("the shared-memory rings")

RESTART = "[stages.runtime]\nrestart = true"
#: The issue's size classes, and the edges of the default inline threshold (64 KiB).
SIZES = [0, 1, 64, 4096, 48 * 1024, 65535, 65536, 65537, 1 << 20]
WINDOW = 64  # wire.Init's defaults: what a request may have unacknowledged per link
WINDOW_BYTES = 1 << 20


def config(
    sizes,
    *,
    repeat=1,
    start=0.0,
    gate=None,
    inline_chunk_bytes=None,
    ring_bytes=None,
    sender="",
    reader="",
    read_delay=0.0,
):
    reader_args = f"{{ delay = {read_delay} }}"
    if gate is not None:
        reader_args = f'{{ gate = "{gate}", delay = {read_delay} }}'
    return pipeline_config(
        ("sends", f"{{ sizes = {sizes}, repeat = {repeat}, start = {start} }}", True, sender),
        ("reads", reader_args, True, reader),
        inline_chunk_bytes=inline_chunk_bytes,
        ring_bytes=ring_bytes,
    )


class Outputs:
    """One request's outputs as they come: stage 0's progress, stage 1's reads."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.by_stage: dict[int, list] = defaultdict(list)
        self.terminal = None

    @property
    def progress(self) -> int:
        sent = self.by_stage[0]
        return sent[-1] if sent else 0

    @property
    def read(self) -> list:
        return self.by_stage[1]

    async def next(self) -> None:
        out = await self.stream.receive()
        if out.data is not None:
            self.by_stage[out.stage_id].append(out.data)
        if out.finish_reason is not None:
            self.terminal = out

    async def until(self, predicate, seconds: float = 10) -> None:
        with trio.fail_after(seconds):
            while not predicate():
                await self.next()

    async def to_the_end(self) -> None:
        await self.until(lambda: self.terminal is not None)

    async def stalled(self, seconds: float = 0.4) -> bool:
        """Whether no output comes for ``seconds``."""
        with trio.move_on_after(seconds):
            await self.next()
            return False
        return True

    async def stalls_at(self, progress: int) -> None:
        """Stage 0 sends ``progress`` chunks, and then no more."""
        await self.until(lambda: self.progress >= progress)
        assert self.progress == progress
        assert await self.stalled()


async def run_requests(orch, request_ids, **kwargs) -> dict[str, Outputs]:
    """Run the requests at once, each to its terminal."""
    results: dict[str, Outputs] = {}

    async def run(request_id):
        async with orch.open_request("p", request_id=request_id, **kwargs) as stream:
            results[request_id] = outputs = Outputs(stream)
            await outputs.to_the_end()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for request_id in request_ids:
                nursery.start_soon(run, request_id)
    return results


def assert_whole(outputs: Outputs, sizes: list[int]) -> None:
    """Every chunk sent, and read whole, in order; the request completed."""
    assert outputs.by_stage[0] == list(range(1, len(sizes) + 1))
    assert outputs.read == sizes
    assert outputs.terminal is not None
    assert outputs.terminal.finish_reason == "completed", outputs.terminal.error


class ShmPeak:
    """The most shared memory the pipeline's prefix held at any sample."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.segments = self.bytes = 0

    def sample(self) -> None:
        names = _shm.listing(self.prefix)
        size = 0
        for name in names:
            try:
                with open(f"{_shm.SHM_DIR}/{name}", "rb") as segment:
                    size += segment.seek(0, 2)
            except FileNotFoundError:
                pass
        self.segments = max(self.segments, len(names))
        self.bytes = max(self.bytes, size)

    async def run(self) -> None:
        while True:
            self.sample()
            await trio.sleep(0.005)


# -- sizes, order, rings ---------------------------------------------------------------------


@pytest.mark.parametrize("inline_chunk_bytes", [None, 0])
async def test_chunks_of_every_size_arrive_whole_and_in_order(inline_chunk_bytes):
    """Three requests at once, each chunk of every size class twice: inline up to the
    threshold (64 KiB by default), through the ring above it (0: every chunk)."""
    sizes = SIZES * 2
    async with running(config(SIZES, repeat=2, inline_chunk_bytes=inline_chunk_bytes)) as (
        pipeline,
        orch,
    ):
        results = await run_requests(orch, ["a", "b", "c"])
        for outputs in results.values():
            assert_whole(outputs, sizes)
        # One link, one ring, of the configured size.
        stats = pipeline.connector.statistics()
        assert (stats.segments_live, stats.shm_bytes) == (1, RING_BYTES)


async def test_chunks_within_the_inline_threshold_make_no_shared_memory():
    sizes = [64, 4096, 48 * 1024, 65536]
    async with running(config(sizes, repeat=3)) as (pipeline, orch):
        peak = ShmPeak(pipeline.prefix)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peak.run)
            results = await run_requests(orch, ["a", "b"])
            nursery.cancel_scope.cancel()
        for outputs in results.values():
            assert_whole(outputs, sizes * 3)
        assert peak.segments == 0


async def test_concurrent_requests_with_full_windows_keep_each_other_going():
    """Four requests' inline chunks at once, each request's window full by its bytes
    (1 MiB is fewer than half a window of 48 KiB chunks): each one's sender waits for
    its own acknowledgements, which its reader sends at once, whatever else it owes."""
    sizes = [48 * 1024]
    repeat = 60
    async with running(config(sizes, repeat=repeat, sender="", reader="")) as (_, orch):
        results = await run_requests(orch, ["a", "b", "c", "d"])
        for outputs in results.values():
            assert_whole(outputs, sizes * repeat)


async def test_the_ring_wraps_around_under_concurrent_requests():
    """A 64 KiB ring carries four requests' 2 MB, chunk after chunk, around and
    around: never more shared memory than the ring, every chunk whole."""
    sizes = [5000, 20000, 12345, 1]
    repeat = 15
    async with running(
        config(sizes, repeat=repeat, inline_chunk_bytes=0, ring_bytes=MIN_RING_BYTES)
    ) as (pipeline, orch):
        peak = ShmPeak(pipeline.prefix)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peak.run)
            results = await run_requests(orch, ["a", "b", "c", "d"])
            nursery.cancel_scope.cancel()
        for outputs in results.values():
            assert_whole(outputs, sizes * repeat)
        assert sum(sizes) * repeat * 4 > 30 * MIN_RING_BYTES  # it went around, many times
        assert (peak.segments, peak.bytes) == (1, MIN_RING_BYTES)


async def test_a_chunk_bigger_than_the_ring_fails_its_request_naming_both_sizes():
    size = MIN_RING_BYTES + 1
    async with running(config([10, size], inline_chunk_bytes=0, ring_bytes=MIN_RING_BYTES)) as (
        _,
        orch,
    ):
        results = await run_requests(orch, ["big"])
        terminal = results["big"].terminal
        assert terminal.finish_reason == "error"
        assert terminal.stage_id == 0
        assert f"a {size}-byte chunk does not fit the {MIN_RING_BYTES}-byte ring" in terminal.error


# -- what holds a sender back ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "window"),
    [(64, WINDOW), (48 * 1024, WINDOW_BYTES // (48 * 1024))],
    ids=["chunks", "bytes"],
)
async def test_a_reader_that_does_not_read_holds_its_sender_to_a_window(tmp_path, size, window):
    """A window of chunks, or of bytes, per request: its sender's engine waits in
    ``io.send`` (its progress stops there); another request on the same link goes
    on meanwhile; once read, the held request completes whole."""
    gate = tmp_path / "go"
    count = 3 * window
    async with running(config([size], repeat=count, start=0.3, gate=gate)) as (_, orch):
        async with orch.open_request("p", request_id="held") as stream:
            held = Outputs(stream)
            await held.stalls_at(window)
            assert held.read == []
            free = await run_requests(orch, ["free"])
            assert_whole(free["free"], [size] * count)
            assert held.progress == window  # still
            gate.touch()
            await held.to_the_end()
        assert_whole(held, [size] * count)


async def test_a_full_ring_makes_its_sender_wait_and_resume(tmp_path):
    """The reader holds the ring's chunks unread: the sender stops when the ring is
    full -- fewer chunks than a window -- and resumes as slots come back."""
    gate = tmp_path / "go"
    size = 16 * 1024
    count = 40
    async with running(
        config(
            [size],
            repeat=count,
            start=0.3,
            gate=gate,
            inline_chunk_bytes=0,
            ring_bytes=MIN_RING_BYTES,
        )
    ) as (pipeline, orch):
        async with orch.open_request("p", request_id="held") as stream:
            held = Outputs(stream)
            await held.until(lambda: held.progress > 0)
            while not await held.stalled():
                pass
            assert 1 <= held.progress <= MIN_RING_BYTES // size
            assert len(_shm.listing(pipeline.prefix)) == 1
            gate.touch()
            await held.to_the_end()
        assert_whole(held, [size] * count)


async def test_a_request_whose_big_chunks_are_never_read_holds_half_the_ring_at_most(tmp_path):
    """Two requests of 1 MiB chunks on one link (4 MiB ring: three slots): "free" is
    streaming, its reader lagging (the ring full of its chunks), when "held" starts,
    whose chunks are never read. "held" gets the next slot that comes back, and no
    more (half the ring: one slot) while "free" streams; "free" goes on in its half
    and completes. (Once it has, "held" is alone and may take the rest.)"""
    gate = tmp_path / "never"
    size = 1 << 20
    count = 40
    async with running(config([size], repeat=count, start=0.3, gate=gate, read_delay=0.02)) as (
        pipeline,
        orch,
    ):
        async with orch.open_request("p", request_id="free") as stream:
            free = Outputs(stream)
            await free.until(lambda: len(free.read) >= 1)  # streaming, the ring full
            async with orch.open_request("p", request_id="held") as held_stream:
                held = Outputs(held_stream)
                await held.until(lambda: held.progress >= 1)
                await free.until(lambda: free.progress >= 10)  # 30 more: 0.6 s at least
                assert await held.stalled(0.1)
                assert (held.progress, held.read) == (1, [])  # one slot: its half
                await free.to_the_end()
                assert_whole(free, [size] * count)
        assert len(_shm.listing(pipeline.prefix)) == 1


async def test_a_text_only_request_does_not_hold_its_sender_up(tmp_path):
    """The talker is never submitted a text-only request, but gets its chunks --
    more than a window, through a small ring: it takes them as they come, so its
    sender is not held; then later requests flow as before."""
    sizes = [64, 30000]
    repeat = WINDOW * 2
    async with running(
        config(sizes, repeat=repeat, inline_chunk_bytes=1024, ring_bytes=MIN_RING_BYTES)
    ) as (pipeline, orch):
        text = await run_requests(orch, ["text"], final_stage_ids={0})
        assert text["text"].by_stage[0] == list(range(1, 2 * repeat + 1))
        assert text["text"].read == []
        assert text["text"].terminal.finish_reason == "completed"
        results = await run_requests(orch, ["audio", "text2"])
        for outputs in results.values():
            assert_whole(outputs, sizes * repeat)
        assert len(_shm.listing(pipeline.prefix)) == 1


# -- aborts and deaths ------------------------------------------------------------------------


async def test_a_request_aborted_mid_stream_gives_its_ring_space_back(tmp_path):
    """The held request fills the ring and is abandoned: its unread chunks' slots
    come back, so the next requests still flow through that small ring."""
    gate = tmp_path / "never"
    size = 16 * 1024
    async with running(
        config(
            [size],
            repeat=30,
            start=0.3,
            gate=gate,
            inline_chunk_bytes=0,
            ring_bytes=MIN_RING_BYTES,
        )
    ) as (pipeline, orch):
        async with orch.open_request("p", request_id="held") as stream:
            held = Outputs(stream)
            await held.until(lambda: held.progress > 0)
            while not await held.stalled():
                pass  # the ring is full of its chunks
        await eventually(lambda: orch.statistics().aborted == 1)
        results = await run_requests(orch, ["after", "after2"])
        for outputs in results.values():
            assert_whole(outputs, [size] * 30)
        assert len(_shm.listing(pipeline.prefix)) == 1


async def test_a_reader_killed_while_its_senders_ring_is_full(tmp_path):
    """Its sender drops that ring (unlinked: /dev/shm never holds more than one
    ring's bytes), waits for the next reader, and streams through a new ring; the
    request that was streaming fails, the next ones complete whole."""
    gate = tmp_path / "never"
    size = 16 * 1024
    async with running(
        config(
            [size],
            repeat=20,
            start=0.3,
            gate=gate,
            inline_chunk_bytes=0,
            ring_bytes=MIN_RING_BYTES,
            reader=RESTART,
        )
    ) as (pipeline, orch):
        peak = ShmPeak(pipeline.prefix)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peak.run)
            async with orch.open_request("p", request_id="held") as stream:
                held = Outputs(stream)
                await held.until(lambda: held.progress > 0)
                while not await held.stalled():
                    pass
                (full,) = _shm.listing(pipeline.prefix)
                pipeline.stages[1].kill()
                await held.to_the_end()
            assert held.terminal.finish_reason == "error"
            assert held.terminal.stage_id == 1
            assert "its worker died: killed by SIGKILL (restarted)" in held.terminal.error
            results = await run_requests(orch, ["after", "after2"])
            nursery.cancel_scope.cancel()
        for outputs in results.values():
            assert_whole(outputs, [size] * 20)
        assert pipeline.stages[1].statistics().restarts == 1
        assert full not in _shm.listing(pipeline.prefix)
        assert len(_shm.listing(pipeline.prefix)) == 1
        assert (peak.segments, peak.bytes) == (1, MIN_RING_BYTES)


async def test_a_sender_killed_while_it_holds_ring_space(tmp_path):
    """Its ring is swept with it; the request it was streaming fails; its successor
    makes a ring of its own, and the next requests complete whole."""
    gate = tmp_path / "never"
    size = 16 * 1024
    async with running(
        config(
            [size],
            repeat=20,
            start=0.3,
            gate=gate,
            inline_chunk_bytes=0,
            ring_bytes=MIN_RING_BYTES,
            sender=RESTART,
        )
    ) as (pipeline, orch):
        thinker = pipeline.stages[0]
        async with orch.open_request("p", request_id="held") as stream:
            held = Outputs(stream)
            await held.until(lambda: held.progress > 0)
            while not await held.stalled():
                pass
            assert _shm.listing(f"{pipeline.prefix}-0-1-") != []
            thinker.kill()
            await held.to_the_end()
        assert held.terminal.finish_reason == "error"
        assert held.terminal.stage_id == 0
        await eventually(lambda: thinker.statistics().restarts == 1)
        assert _shm.listing(f"{pipeline.prefix}-0-1-") == []  # swept with its worker
        results = await run_requests(orch, ["after", "after2"])
        for outputs in results.values():
            assert_whole(outputs, [size] * 20)
        (ring,) = _shm.listing(pipeline.prefix)
        assert ring.startswith(f"{pipeline.prefix}-0-2-")
