"""``stream_in_thread``: blocking code that streams, read from Trio as it comes --
in order, in batches, with its errors, and stopped (and waited for) when its
reader goes away. Real threads, so real time: every wait here is bounded."""

from __future__ import annotations

import threading
from contextlib import aclosing

import pytest
import trio

from omni_trio.process import SimulationError, stream_in_thread
from omni_trio.process.worker import _threads


async def collect(produce, what="a test"):
    batches = []
    async with aclosing(stream_in_thread(produce, what=what)) as stream:
        async for batch in stream:
            batches.append(batch)
    return batches


async def test_items_arrive_in_order_and_the_return_value_is_dropped():
    def produce(emit):
        for i in range(100):
            assert emit(i) is False  # someone listens
        return "dropped"

    batches = await collect(produce)
    assert [i for batch in batches for i in batch] == list(range(100))
    assert all(batches)  # no empty batch is handed on


async def test_a_reader_behind_takes_the_backlog_as_one_batch():
    go, emitted = threading.Event(), threading.Event()

    def produce(emit):
        emit(0)
        go.wait(5)
        for i in range(1, 1000):
            emit(i)
        emitted.set()

    def let_it_run():
        go.set()
        emitted.wait(5)

    batches = []
    async with aclosing(stream_in_thread(produce, what="a test")) as stream:
        async for batch in stream:
            batches.append(batch)
            if batch == [0]:  # the reader falls behind: all the rest comes meanwhile
                await trio.to_thread.run_sync(let_it_run)
    assert batches == [[0], list(range(1, 1000))]


async def test_what_the_producer_raises_comes_after_what_it_emitted():
    def produce(emit):
        emit("a")
        emit("b")
        raise ValueError("the model broke")

    seen = []

    async def read():
        async with aclosing(stream_in_thread(produce, what="a test")) as stream:
            async for batch in stream:
                seen.extend(batch)

    with pytest.raises(ValueError, match="the model broke"):
        await read()
    assert seen == ["a", "b"]


class Endless:
    """A producer that emits until it is told to stop, and records when it returned."""

    def __init__(self) -> None:
        self.returned = threading.Event()
        self.told_to_stop = False

    def __call__(self, emit):
        try:
            while not emit("token"):
                threading.Event().wait(0.001)  # a model's pace
            self.told_to_stop = True
        finally:
            self.returned.set()


async def test_a_reader_that_leaves_early_stops_the_producer_and_waits_for_it():
    producer = Endless()
    async with aclosing(stream_in_thread(producer, what="a test")) as stream:
        async for _ in stream:
            break
    # aclose returned: the thread has returned too, told to stop by emit
    assert producer.returned.is_set()
    assert producer.told_to_stop


async def test_a_cancelled_reader_stops_the_producer_and_waits_for_it():
    producer = Endless()
    with trio.move_on_after(0.05) as scope:
        async with aclosing(stream_in_thread(producer, what="a test")) as stream:
            async for _ in stream:
                pass
    assert scope.cancelled_caught
    assert producer.returned.is_set()
    assert producer.told_to_stop


async def test_a_producer_that_never_stops_is_waited_for_at_most_the_bound(monkeypatch):
    monkeypatch.setattr(_threads, "STOP_BOUND", 0.1)
    release = threading.Event()

    def deaf(emit):
        emit("one")
        release.wait(10)  # it never looks at emit's answer again

    try:
        with trio.fail_after(5):  # the bound, not the producer, ends the wait
            async with aclosing(stream_in_thread(deaf, what="a test")) as stream:
                async for _ in stream:
                    break
    finally:
        release.set()


async def test_a_simulated_worker_refuses_it():
    token = _threads.IN_SIMULATION.set(True)
    try:
        with pytest.raises(SimulationError, match=r"simulation cannot run llama\.cpp"):
            await collect(lambda emit: None, what="llama.cpp")
    finally:
        _threads.IN_SIMULATION.reset(token)
