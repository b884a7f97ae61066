"""The worker's request bookkeeping, in-process: the races a real process only hits
now and then, made to happen every time."""

from __future__ import annotations

import trio
import trio.testing

from omni_trio.process import _shm
from omni_trio.process._wire import Abort, Chunk, FrameWriter, Init, Release, Submit
from omni_trio.process.worker import _Worker
from process_engines import relay


def make_worker(prefix: str) -> _Worker:
    init = Init(1, "relay", "process_engines:relay", {}, prefix)
    control = FrameWriter(trio.testing.MemorySendStream())
    chunks = FrameWriter(trio.testing.MemorySendStream())
    return _Worker(init, relay(), control, chunks)


def upstream_chunk(prefix: str, request_id: str, seq: int) -> Chunk:
    name = f"{prefix}-0-9-{seq}"
    return Chunk(request_id, name, _shm.create(name, b"chunk"))


async def test_a_chunk_taken_as_the_request_is_released_leaves_no_segment():
    """The engine was already woken with an upstream chunk when Abort and Release
    arrived: its resumed ``io.send`` must not create a segment nobody will free."""
    prefix = _shm.new_prefix()
    worker = make_worker(prefix)
    try:
        async with trio.open_nursery() as nursery:
            worker.handle(Submit("r", None), nursery)
            await trio.testing.wait_all_tasks_blocked()  # the engine waits for chunks
            worker.on_chunks([upstream_chunk(prefix, "r", 0)])  # wakes it, with a chunk
            worker.handle(Abort("r"), nursery)  # ... and before it runs:
            worker.handle(Release("r"), nursery)
            await trio.testing.wait_all_tasks_blocked()
        assert _shm.listing(f"{prefix}-1-") == []
        assert worker.requests == {}
    finally:
        _shm.sweep(prefix)


async def test_chunks_after_the_release_are_dropped():
    """Data can trail control: a chunk for a released request must not bring it back."""
    prefix = _shm.new_prefix()
    worker = make_worker(prefix)
    try:
        async with trio.open_nursery() as nursery:
            worker.handle(Submit("r", None), nursery)
            await trio.testing.wait_all_tasks_blocked()
            worker.handle(Release("r"), nursery)
            worker.on_chunks([upstream_chunk(prefix, "r", 0)])
            await trio.testing.wait_all_tasks_blocked()
        assert worker.requests == {}
    finally:
        _shm.sweep(prefix)


async def test_chunks_may_arrive_before_their_submit():
    prefix = _shm.new_prefix()
    worker = make_worker(prefix)
    try:
        async with trio.open_nursery() as nursery:
            worker.on_chunks([upstream_chunk(prefix, "r", 0)])
            assert "r" in worker.requests  # kept for the submit to come
            worker.handle(Submit("r", None), nursery)
            await trio.testing.wait_all_tasks_blocked()
            assert _shm.listing(f"{prefix}-1-") == [f"{prefix}-1-1-0"]  # passed on
            worker.handle(Release("r"), nursery)
        assert _shm.listing(f"{prefix}-1-") == []
    finally:
        _shm.sweep(prefix)


async def test_released_ids_are_remembered_up_to_a_bound_and_a_new_submit_forgets_one(
    monkeypatch,
):
    monkeypatch.setattr("omni_trio.process.worker._REMEMBER_RELEASED", 2)
    prefix = _shm.new_prefix()
    worker = make_worker(prefix)
    try:
        async with trio.open_nursery() as nursery:
            for rid in ("a", "b", "c"):
                worker.release(rid)
            assert list(worker.released) == ["b", "c"]  # "a" forgotten: bounded
            worker.handle(Submit("c", None), nursery)  # "c" is reused: a new life
            assert "c" not in worker.released
            worker.on_chunks([upstream_chunk(prefix, "c", 0)])
            await trio.testing.wait_all_tasks_blocked()
            assert _shm.listing(f"{prefix}-1-") == [f"{prefix}-1-1-0"]  # it got the chunk
            worker.release_all()
        assert _shm.listing(f"{prefix}-1-") == []
    finally:
        _shm.sweep(prefix)
