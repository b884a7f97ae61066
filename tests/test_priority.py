"""Priority: the sans-IO waiting list and slot table (no event loop), and
:class:`omni_trio.PrioritySlots` and the orchestrator's admission on Trio."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from omni_trio import PrioritySlots, StageOutput, StageRequest, open_orchestrator
from omni_trio._priority import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    SlotTable,
    WaitList,
    check_aging,
    check_priority,
    rank,
)
from omni_trio.bench._replicas import DEVICE_TOML
from omni_trio.config import parse_pipeline
from omni_trio.process import ChunkIO, EngineRequest, open_inprocess_stage
from omni_trio.testing import open_simulated_pipeline
from omni_trio.testing._invariants import check_outputs, check_released, terminal_of

# -- the sans-IO parts -------------------------------------------------------------------


def test_a_waiting_list_serves_the_lowest_priority_first_and_in_order_on_a_tie() -> None:
    waiting: WaitList[str] = WaitList(aging_s=None)
    for name, priority in [("a", 0), ("b", 5), ("c", -3), ("d", 0), ("e", -3)]:
        waiting.push(name, priority, now=0.0)
    assert [waiting.pop().item for _ in range(5)] == ["c", "e", "a", "d", "b"]
    assert len(waiting) == 0
    with pytest.raises(IndexError):
        waiting.pop()


def test_aging_lets_a_long_waiter_go_ahead_of_a_more_urgent_newcomer() -> None:
    waiting: WaitList[str] = WaitList(aging_s=1.0)
    waiting.push("old batch", 5, now=0.0)
    waiting.push("new, urgent but not by enough", 1, now=4.5)  # 5 + 0 < 1 + 4.5
    waiting.push("new and urgent enough", 0, now=4.5)  # 0 + 4.5 < 5
    assert [waiting.pop().item for _ in range(3)] == [
        "new and urgent enough",
        "old batch",
        "new, urgent but not by enough",
    ]


def test_a_removed_waiter_is_skipped_and_the_last_is_what_an_overload_sheds() -> None:
    waiting: WaitList[str] = WaitList()
    a = waiting.push("a", 0, 0.0)
    b = waiting.push("b", 3, 0.0)
    waiting.push("c", 1, 0.0)
    last = waiting.last()
    assert last is not None
    assert last.item == "b"
    assert waiting.remove(a)
    assert not waiting.remove(a)
    assert len(waiting) == 2
    assert waiting.pop().item == "c"
    assert waiting.remove(b)
    assert waiting.peek() is None
    assert waiting.last() is None


@given(
    st.lists(
        st.tuples(st.integers(-5, 5), st.floats(0, 100, allow_nan=False)),
        min_size=1,
        max_size=30,
    ),
    st.floats(0.1, 10),
)
def test_the_order_is_the_aged_priority_at_any_time_after_every_arrival(
    arrivals: list[tuple[int, float]], aging_s: float
) -> None:
    """The rank fixed at arrival orders the waiters as their priority less their
    wait over ``aging_s`` does, at any later time."""
    waiting: WaitList[int] = WaitList(aging_s)
    for index, (priority, at) in enumerate(arrivals):
        waiting.push(index, priority, at)
    later = max(at for _, at in arrivals) + 1.0
    served = [waiting.pop().item for _ in arrivals]

    def aged(index: int) -> float:
        priority, at = arrivals[index]
        return priority - (later - at) / aging_s

    for first, second in itertools.pairwise(served):
        assert aged(first) <= aged(second) + 1e-6


def test_a_slot_table_keeps_its_reserved_slots_for_urgent_requests() -> None:
    table: SlotTable[str] = SlotTable(3, reserved=1, reserved_for=-1)
    assert table.take(0)
    assert table.take(0)
    assert not table.take(0)  # the last one is kept
    table.wait("batch", 0, now=0.0)
    assert table.take(-1)  # an urgent request finds it free
    assert table.in_use == 3
    assert table.give_back() == []  # only the reserved one is free
    assert not table.take(0)
    assert [w.item for w in table.give_back()] == ["batch"]
    assert table.in_use == 2


def test_a_freed_slot_goes_to_the_best_waiter_that_may_use_it() -> None:
    table: SlotTable[str] = SlotTable(2, reserved=1)
    assert table.take(0)
    assert table.take(-1)
    table.wait("batch", 0, now=0.0)
    table.wait("voice", -2, now=1.0)
    # the urgent one first: its rank (-2 + 1) beats the batch's (0 + 0)
    assert [w.item for w in table.give_back()] == ["voice"]
    # only the reserved slot would be free: the batch request may not take it
    assert table.give_back() == []
    assert table.in_use == 1
    assert [w.item for w in table.give_back()] == ["batch"]


def test_a_cancelled_waiter_says_whether_it_was_handed_a_slot() -> None:
    table: SlotTable[str] = SlotTable(1)
    assert table.take(0)
    first = table.wait("first", 0, 0.0)
    second = table.wait("second", 0, 0.0)
    assert table.cancel(second)  # still waiting: removed
    assert [w.item for w in table.give_back()] == ["first"]
    assert not table.cancel(first)  # it holds the slot: give it back
    assert table.waiting == 0


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (1.5, "got 1.5"),
        ("1", "got '1'"),
        (True, "got True"),
        (PRIORITY_MIN - 1, f"from {PRIORITY_MIN} to {PRIORITY_MAX}"),
        (PRIORITY_MAX + 1, "got 1001"),
    ],
)
def test_a_bad_priority_is_a_value_error_naming_it(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match="priority must be an integer") as caught:
        check_priority(value)
    assert fragment in str(caught.value)


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, "1", True])
def test_a_bad_aging_period_is_a_value_error_naming_it(value: object) -> None:
    with pytest.raises(ValueError, match="priority_aging_s must be a positive number"):
        check_aging(value)


def test_a_bad_slot_count_or_reservation_names_it() -> None:
    with pytest.raises(ValueError, match="slots must be a positive integer, got 0"):
        SlotTable(0)
    with pytest.raises(ValueError, match="reserved slots must be an integer from 0 to 1"):
        SlotTable(2, reserved=2)
    with pytest.raises(ValueError, match="reserved_for must be an integer"):
        SlotTable(2, reserved=1, reserved_for=0.5)  # type: ignore[arg-type]


def test_without_aging_the_rank_is_the_priority() -> None:
    assert rank(3, 1e9, None) == 3.0
    assert rank(3, 10.0, 2.0) == 8.0


# -- PrioritySlots, on Trio --------------------------------------------------------------


async def _take_in_order(slots: PrioritySlots, asks: list[tuple[str, int]]) -> list[str]:
    order: list[str] = []

    async def ask(name: str, priority: int) -> None:
        async with slots.slot(priority):
            order.append(name)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for name, priority in asks:
            nursery.start_soon(ask, name, priority)
            await trio.sleep(0.001)  # they arrive in this order
    return order


async def test_priority_slots_hand_a_freed_slot_to_the_most_urgent_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots = PrioritySlots(1, aging_s=None)
    order = await _take_in_order(slots, [("first", 0), ("low", 5), ("high", -5), ("mid", 0)])
    assert order == ["first", "high", "mid", "low"]


async def test_priority_slots_age_a_waiter_past_newcomers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One slot, held 1 s at a time, and a request of priority 0 arriving every
    second: one of priority 3 is overtaken only by those that arrive within 3 s
    of it (3 steps times ``aging_s``), then served."""
    slots = PrioritySlots(1, aging_s=1.0)
    served: list[tuple[str, float]] = []

    async def ask(name: str, priority: int) -> None:
        async with slots.slot(priority):
            served.append((name, trio.current_time()))
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "urgent 0", 0)
        await trio.sleep(0.001)
        nursery.start_soon(ask, "batch", 3)
        await trio.sleep(0.499)
        for index in range(1, 8):
            nursery.start_soon(ask, f"urgent {index}", 0)  # at index - 0.5 s
            await trio.sleep(1)
    names = [name for name, _ in served]
    assert names[:5] == ["urgent 0", "urgent 1", "urgent 2", "urgent 3", "batch"]
    assert served[4][1] == 4.0


async def test_priority_slots_reserved_for_urgent_requests_admit_one_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots = PrioritySlots(4, reserved=1)
    started: dict[str, float] = {}

    async def ask(name: str, priority: int) -> None:
        async with slots.slot(priority) as waited:
            started[name] = waited
            await trio.sleep(10)

    async with trio.open_nursery() as nursery:
        for index in range(8):
            nursery.start_soon(ask, f"batch {index}", 0)
        await trio.sleep(1)
        stats = slots.statistics()
        assert (stats.in_use, stats.waiting, stats.waiting_by_priority) == (3, 5, {0: 5})
        nursery.start_soon(ask, "voice", -10)
        await trio.sleep(0.5)
        assert started["voice"] == 0.0  # it found the reserved slot free
    assert slots.statistics().in_use == 0


async def test_a_task_cancelled_while_it_waits_holds_no_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots = PrioritySlots(1)
    async with slots.slot():
        with trio.move_on_after(1):
            await slots.acquire(-5)
        assert slots.statistics().waiting == 0
    assert slots.available(0)
    with pytest.raises(ValueError, match="priority must be an integer"):
        await slots.acquire(0.5)  # type: ignore[arg-type]


# -- the orchestrator's admission --------------------------------------------------------


class _Holding:
    """A stage that finishes a request when told to."""

    def __init__(self) -> None:
        self.send, self.outputs = trio.open_memory_channel[StageOutput](100)
        self.submitted: list[tuple[str, int]] = []

    async def submit(self, request: StageRequest) -> None:
        self.submitted.append((request.request_id, request.priority))

    async def abort(self, request_id: str) -> None:
        pass

    def finish(self, request_id: str) -> None:
        self.send.send_nowait(StageOutput(request_id, "done", finished=True))


async def test_admission_lets_the_most_urgent_waiter_in_first_and_every_submit_carries_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stage = _Holding()
    async with open_orchestrator([stage], {0}, prewarm_fn=lambda k, p: p, max_in_flight=1) as orch:
        async with trio.open_nursery() as nursery:
            for request_id, priority in [("running", 0), ("batch", 5), ("chat", 0), ("voice", -10)]:

                async def add(request_id: str = request_id, priority: int = priority) -> None:
                    await orch.add_request(request_id, "hi", priority=priority)

                nursery.start_soon(add)
                await trio.sleep(0.01)
            assert orch.statistics().admissions_waiting == 3
            for _ in range(4):
                await trio.sleep(0.01)
                stage.finish(stage.submitted[-1][0])
                await orch.next_output()
        assert stage.submitted == [("running", 0), ("voice", -10), ("chat", 0), ("batch", 5)]
        with pytest.raises(ValueError, match="priority must be an integer"):
            await orch.add_request("bad", "hi", priority=2000)


# -- aging through a whole simulated pipeline --------------------------------------------

#: The device bench's pipeline: a host stage hands each request's step count to a
#: device stage of one slot (20 ms steps), which serves its waiters by priority.
SIMULATED_DEVICE = DEVICE_TOML.format(step_seconds=0.020, batch=1, replicas=1)


@pytest.mark.parametrize("seed", range(3))
async def test_a_simulated_pipeline_serves_mixed_priorities_in_aged_order(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    """Thirty requests of priorities 0-3, 100 ms apart, each 5-15 steps of the one
    slot (twice the work the slot can do): the invariants hold, and each request
    got the slot ahead of every one waiting then whose aged priority was worse.
    With 1 s per step of aging and a queue that grows to seconds, aging decides
    part of the order (strict priority would fail this)."""
    rng = random.Random(seed)
    asks = [(rng.randrange(4), rng.randrange(5, 16)) for _ in range(30)]
    opened: dict[int, float] = {}
    first: dict[int, float] = {}
    async with open_simulated_pipeline(parse_pipeline(SIMULATED_DEVICE), seed=seed) as sim:

        async def ask(index: int, priority: int, steps: int) -> None:
            opened[index] = trio.current_time()
            async with sim.open_request({"steps": steps}, priority=priority) as stream:
                async for _ in stream:
                    first.setdefault(index, trio.current_time())

        async with trio.open_nursery() as nursery:
            for index, (priority, steps) in enumerate(asks):
                nursery.start_soon(ask, index, priority, steps)
                await trio.sleep(0.1)
    records = sim.requests
    assert check_outputs(records, lambda record, out: True, lambda record: None) == []
    assert check_released(sim) == []
    assert all(terminal_of(r).finish_reason == "completed" for r in records)  # type: ignore[union-attr]
    step, slack = 0.020, 0.003  # a grant comes one step before the first output
    for x in first:
        granted = first[x] - step
        for y in first:
            if first[y] > first[x] and opened[y] < granted - slack:  # y was waiting
                rank_x = asks[x][0] + opened[x]
                rank_y = asks[y][0] + opened[y]
                assert rank_x <= rank_y + slack, (x, y, asks[x], asks[y])


# -- the asyncio twin ---------------------------------------------------------------------


def test_the_asyncio_twin_admits_by_priority_too() -> None:
    from omni_trio.compare import open_asyncio_orchestrator
    from omni_trio.compare.asyncio_testing import (
        AsyncioScriptedStage,
        run_with_virtual_time,
        wait_all_tasks_blocked,
    )

    async def main() -> list[str]:
        import asyncio

        stage = AsyncioScriptedStage()
        async with open_asyncio_orchestrator(
            [stage], {0}, prewarm_fn=lambda k, p: p, max_in_flight=1
        ) as orch:
            tasks = []
            for name, priority in [("running", 0), ("batch", 5), ("chat", 0), ("voice", -10)]:
                tasks.append(asyncio.create_task(orch.add_request(name, name, priority=priority)))
                await wait_all_tasks_blocked()
            for _ in range(4):
                await wait_all_tasks_blocked()
                await stage.emit(stage.submitted_ids()[-1], "done", finished=True)
                await orch.next_output()
            await asyncio.gather(*tasks)
            with pytest.raises(ValueError, match="priority must be an integer"):
                await orch.add_request("bad", "x", priority=True)  # type: ignore[arg-type]
            return stage.submitted_ids()

    assert run_with_virtual_time(main) == ["running", "voice", "chat", "batch"]


# -- an engine's slots, reported by its worker --------------------------------------------


def holding_engine() -> Any:
    """An engine of one slot, by priority, that holds it until its request is
    aborted; ``engine.slots`` tells its worker who waits."""
    slots = PrioritySlots(1)

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        async with slots.slot(request.priority):
            yield request.request_id
            await trio.sleep_forever()

    engine.slots = slots  # type: ignore[attr-defined]
    return engine


async def slots_waiting(stage: Any, count: int) -> None:
    with trio.fail_after(5):
        while (await stage.refresh_statistics()).slots_waiting != count:  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_a_worker_reports_the_requests_waiting_for_its_engines_slots() -> None:
    """Three requests for one slot: the worker reports two waiting; when the first
    is aborted, the most urgent waiter (priority -5) takes the slot, not the one
    that came first (priority 5)."""
    async with (
        open_inprocess_stage(holding_engine) as stage,
        open_orchestrator([stage], {0}, prewarm_fn=lambda k, p: p) as orch,
    ):
        async with AsyncExitStack() as stack:
            streams = [
                await stack.enter_async_context(
                    orch.open_request(index, request_id=f"r{index}", priority=priority)
                )
                for index, priority in enumerate([0, 5, -5])
            ]
            assert (await streams[0].receive()).data == "r0"
            await slots_waiting(stage, 2)
            await orch.abort("r0")
            assert (await streams[2].receive()).data == "r2"
            await slots_waiting(stage, 1)
        await slots_waiting(stage, 0)  # leaving aborted the others


# -- the other queues' orders -----------------------------------------------------------


def test_a_restarting_replicas_waiting_submits_go_to_its_next_worker_by_priority() -> None:
    from omni_trio.process._replica import Replica, _PendingSubmit

    replica = object.__new__(Replica)  # its queue alone: no worker, no supervisor
    replica._pending = {
        request_id: _PendingSubmit(request_id.encode(), 30.0, rank(priority, at, 1.0))
        for request_id, priority, at in [
            ("batch", 5, 0.0),
            ("chat", 0, 1.0),
            ("voice", -10, 2.0),
            ("old batch", 5, -10.0),  # waited 10 s longer: aged past the chat
            ("chat 2", 0, 1.0),
        ]
    }
    replica._lives = {}
    sent: list[str] = []

    class Worker:
        def submit(self, request_id: str, frame: bytes, life: int) -> None:
            sent.append(request_id)

        def credit(self, request_id: str, outputs: int, nbytes: int) -> None:
            raise AssertionError("no credit was given")

    replica._send_pending(Worker())  # type: ignore[arg-type]
    assert sent == ["voice", "old batch", "chat", "chat 2", "batch"]
    assert replica._pending == {}


def test_least_loaded_breaks_a_tie_by_the_requests_ahead_of_the_new_one() -> None:
    from omni_trio.process._placement import choose_least_loaded

    live = [True, True, True]
    assert choose_least_loaded(live, [2, 1, 1]) == 1  # the first on a tie
    assert choose_least_loaded(live, [2, 1, 1], ahead=[0, 1, 0]) == 2
    assert choose_least_loaded(live, [0, 1, 1], ahead=[5, 0, 0]) == 0  # load first


class _Control:
    """A control connection as the gate sees it: bytes queued, a high water."""

    def __init__(self) -> None:
        self.queued = 0
        self.high_water = 50
        self.on_written: Any = None


async def test_the_workers_gate_lets_engines_in_by_priority(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from omni_trio.process.worker._requests import Gate

    control = _Control()
    gate = Gate(control)  # type: ignore[arg-type]
    await gate.enter()
    gate.leave(60)  # an output of 60 bytes: one engine at a time fits under 50
    control.queued = 1000  # backlogged: every engine waits
    order: list[str] = []

    async def engine(name: str, priority: int) -> None:
        await gate.enter(priority)
        order.append(name)
        await trio.sleep(0.01)
        gate.leave(60)  # the next one goes in as this one leaves

    async with trio.open_nursery() as nursery:
        for name, priority in [("batch", 5), ("chat", 0), ("voice", -10), ("chat 2", 0)]:
            nursery.start_soon(engine, name, priority)
            await trio.sleep(0.01)
        assert gate.waiting == 4
        with trio.move_on_after(1):  # one cancelled while it waits holds no place
            await gate.enter(-20)
        control.queued = 0
        control.on_written()  # the backlog was written: engines go in, in order
    assert order == ["voice", "chat", "chat 2", "batch"]
    assert (gate.waiting, gate.inside) == (0, 0)


@given(
    st.integers(1, 4),
    st.integers(0, 3),
    st.lists(
        st.tuples(st.sampled_from(["ask", "give", "cancel"]), st.integers(-3, 3)),
        max_size=60,
    ),
)
def test_a_slot_table_never_leaves_a_slot_free_that_a_waiter_may_take(
    total: int, reserved: int, steps: list[tuple[str, int]]
) -> None:
    """Whatever the asks, give-backs and cancels: slots in use never exceed the
    total, nothing is handed out twice, and no waiter waits while a slot it may
    take is free."""
    reserved = min(reserved, total - 1)
    table: SlotTable[int] = SlotTable(total, reserved=reserved, reserved_for=-1)
    holding: list[int] = []  # the asks holding a slot
    waiting: dict[int, Any] = {}
    for index, (step, priority) in enumerate(steps):
        if step == "ask":
            if table.take(priority):
                holding.append(index)
            else:
                waiting[index] = table.wait(index, priority, now=float(index))
        elif step == "give" and holding:
            holding.pop(0)
            for waiter in table.give_back():
                holding.append(waiting.pop(waiter.item))
        elif step == "cancel" and waiting:
            key = sorted(waiting)[priority % len(waiting)]
            assert table.cancel(waiting.pop(key))
        free = total - table.in_use
        assert table.in_use == len(holding) <= total
        assert len(set(holding)) == len(holding)
        assert table.waiting == len(waiting)
        urgent = [w for w in waiting.values() if w.priority <= -1]
        assert not (urgent and free > 0)
        assert not (len(urgent) < len(waiting) and free > reserved)
