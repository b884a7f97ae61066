"""Flow control per request: what a consumer leaves unread is bounded, in outputs,
bytes and time, and a request over its bound holds only its own engines.

The ledger is sans-IO (tested without an event loop first); then every orchestrator
(Trio, the asyncio twin, the plain design) with scripted stages that take credit;
then real workers, whose engines are held.
"""

from __future__ import annotations

import pytest
import trio

from frameworks import batched, both
from helpers import join_forward, warm
from omni_trio import OrchOutput
from omni_trio._core import StageCredit
from omni_trio._flow import FlowLedger, FlowLimits
from omni_trio._sink import OutboxBase
from omni_trio._util import output_size
from processes import pipeline_config, running

KIB = 1024


class ListOutbox(OutboxBase):
    """An outbox with no framework: flushed batches go straight into the buffer."""

    def _send_batch(self, batch):
        self._take(batch)

    def _close_channel(self):
        pass

    def _receive_batch_nowait(self):
        return None

    def take(self, count):
        """The consumer takes ``count`` outputs (and settles, as before it waits)."""
        taken = [self._buffer.popleft() for _ in range(count)]
        self.reconcile()
        return taken


SMALL = FlowLimits(1000, 10, 0)


def ledger(limits=SMALL, takes_credit=(True, True, True)):
    sent: list[StageCredit] = []
    flow = FlowLedger(
        len(takes_credit),
        limits,
        takes_credit=takes_credit,
        send_credit=sent.append,
        credit=StageCredit,
    )
    return flow, sent


def stream_of(flow, request_id, finals=frozenset({0})):
    flow.open(request_id, finals)
    outbox = ListOutbox(flow, request_id)
    flow.attach(outbox)
    return outbox


def flush(outbox, *outputs, at=0.0):
    outbox.flow.now = at
    for output in outputs:
        outbox.put(output)
    outbox.flush()


def out(request_id, stage_id, data, finished=False):
    return OrchOutput(request_id, stage_id, data, finished, "completed" if finished else None)


# -- the ledger and the outboxes, sans-IO ------------------------------------------------


def test_the_counting_rule():
    assert output_size(b"abc") == 3
    assert output_size(bytearray(5)) == 5
    assert output_size(memoryview(b"abcd").cast("B")) == 4
    assert output_size("héllo") == 5  # characters, as len() counts a str
    assert output_size(None) == 0
    assert output_size([1, 2, 3]) == 0
    assert output_size({"a": b"xyz"}) == 0


def test_a_requests_window_is_split_among_its_final_stages_that_take_credit():
    flow, _ = ledger(takes_credit=(True, False, True))
    flow.open("r", frozenset({0, 1, 2}))
    assert flow.first_credit(0, "r") == StageCredit(0, "r", 3, 333)
    assert flow.first_credit(1, "r") is None  # no credit method: never held
    assert flow.first_credit(2, "r") == StageCredit(2, "r", 3, 333)
    flow.open("t", frozenset({2}))
    assert flow.first_credit(2, "t") == StageCredit(2, "t", 10, 1000)
    assert flow.first_credit(0, "t") is None  # not one of its final stages


def test_credit_comes_back_once_half_a_window_is_taken():
    flow, sent = ledger()
    outbox = stream_of(flow, "r")
    for _ in range(6):
        flush(outbox, out("r", 0, b"x" * 100))
    assert flow.unread() == ([6, 0, 0], [600, 0, 0])
    outbox.take(4)
    assert sent == []  # 4 of 10 outputs, 400 of 1000 bytes: under half of either
    outbox.take(1)  # 5 outputs: half the outputs' window
    assert sent == [StageCredit(0, "r", 5, 500)]
    outbox.take(1)
    assert sent == [StageCredit(0, "r", 5, 500)]  # owed: 1, 100
    assert flow.unread() == ([0, 0, 0], [0, 0, 0])


def test_what_the_consumer_holds_is_unread_until_it_comes_back():
    flow, sent = ledger()
    outbox = stream_of(flow, "r")
    flush(outbox, *(out("r", 0, b"y" * 100) for _ in range(5)))
    outbox.in_hand = outbox.take_ready()  # taken as one batch, and being written out
    outbox.reconcile()
    assert (sent, flow.unread()) == ([], ([5, 0, 0], [500, 0, 0]))
    outbox.in_hand = None  # it asks for more
    outbox.reconcile()
    assert sent == [StageCredit(0, "r", 5, 500)]


def test_a_big_output_returns_its_bytes_at_once():
    flow, sent = ledger()
    outbox = stream_of(flow, "r")
    flush(outbox, out("r", 0, "y" * 600))
    outbox.take(1)
    assert sent == [StageCredit(0, "r", 1, 600)]


def test_an_ended_request_gets_no_credit_and_its_account_closes_once_its_terminal_is_taken():
    flow, sent = ledger()
    results = ListOutbox(flow)
    flow.attach(results)
    flow.open("r", frozenset({0}))
    flush(results, *(out("r", 0, b"z" * 300) for _ in range(3)))
    flow.end("r")  # the handler emits its terminal
    results.put(out("r", 0, b"end", True))
    results.note_terminal("r")
    results.flush()
    assert len(flow) == 1
    results.take(3)
    assert (sent, len(flow)) == ([], 1)  # its terminal waits: it still counts
    results.take(1)
    assert len(flow) == 0
    assert flow.unread() == ([0, 0, 0], [0, 0, 0])


def test_the_idle_clock_counts_only_outputs_waiting():
    flow, _ = ledger(FlowLimits(1000, 10, 5.0))
    outbox = stream_of(flow, "r")
    assert flow.next_deadline() is None  # nothing waits: a slow producer is not idle
    flush(outbox, out("r", 0, "a"), at=1.0)
    flush(outbox, out("r", 0, "b"), at=4.0)
    assert flow.next_deadline() == 6.0
    assert flow.expire(5.9) == []
    outbox.take(1)  # the oldest was taken: the clock follows the next one
    assert flow.expire(6.0) == []
    assert flow.next_deadline() == 9.0
    assert flow.expire(9.0) == ["r"]
    assert flow.expire(100.0) == []  # named once
    assert flow.next_deadline() is None


def test_an_output_is_idle_at_its_deadline_whatever_the_rounding():
    """0.187719 + 0.5 == 0.687719, but 0.687719 - 0.5 < 0.187719: an output flushed
    at 0.187719 must be idle at the deadline it was armed for. (Compared with
    ``now - timeout``, it was not, and expire() armed it again at the same instant
    for ever: a seeded simulation hung there.)"""
    flow, _ = ledger(FlowLimits(1000, 10, 0.5))
    outbox = stream_of(flow, "r")
    flush(outbox, out("r", 0, "a"), at=0.187719)
    deadline = flow.next_deadline()
    assert deadline == 0.187719 + 0.5
    assert deadline - 0.5 < 0.187719  # the rounding that bit
    assert flow.expire(deadline) == ["r"]
    assert flow.next_deadline() is None


def test_a_closed_stream_stops_counting():
    flow, sent = ledger()
    outbox = stream_of(flow, "r")
    flush(outbox, *(out("r", 0, b"q" * 400) for _ in range(3)))
    outbox.close_account()
    assert (sent, len(flow), flow.unread()) == ([], 0, ([0, 0, 0], [0, 0, 0]))


# -- every orchestrator, scripted stages ------------------------------------------------


@both
async def test_a_final_stage_gets_its_window_before_the_submit(fw):
    order = []
    stage = fw.ScriptedStage(takes_credit=True)
    credit = stage.credit

    async def first(*args):
        order.append("credit")
        await credit(*args)

    stage.credit = first

    async def submitted(request_id, inputs):
        order.append("submit")

    stage._on_submit = submitted
    async with fw.open_orchestrator(
        [stage], {0}, prewarm_fn=warm, max_unread_outputs=8, max_unread_bytes=64
    ) as orch:
        await orch.add_request("r", "p")
        await fw.settle()
        assert order == ["credit", "submit"]
        assert stage.credits == [("r", 8, 64)]


@both
async def test_credit_follows_the_consumer_of_a_stream(fw):
    stage = fw.ScriptedStage(takes_credit=True)
    async with fw.open_orchestrator(
        [stage], {0}, prewarm_fn=warm, max_unread_outputs=4, max_unread_bytes=KIB
    ) as orch:
        async with orch.open_request("p", request_id="r") as stream:
            for _ in range(4):
                stage.emit_nowait("r", "tok")
            await fw.settle()
            stats = orch.statistics()
            assert (stats.unread_outputs, stats.unread_bytes) == ((4,), (12,))
            assert stage.granted("r") == (4, KIB)  # the window: nothing back yet
            for _ in range(4):
                assert (await stream.receive()).data == "tok"
            await fw.settle()
            assert stage.granted("r") == (4, KIB)  # it holds the last one
            assert orch.statistics().unread_outputs == (1,)
            async with fw.open_tasks() as tasks:
                tasks.start_soon(stream.receive)  # it comes back, and waits
                await fw.settle()
                assert stage.granted("r") == (8, KIB + 12)  # all four read: credit back
                assert orch.statistics().unread_outputs == (0,)
                await stage.emit("r", "end", finished=True)
        stats = orch.statistics()
        assert (stats.unread_outputs, stats.unread_requests) == ((0,), 0)


@batched
async def test_a_batch_in_the_consumers_hands_counts_until_it_asks_for_more(fw):
    stage = fw.ScriptedStage(takes_credit=True)
    async with fw.open_orchestrator(
        [stage], {0}, prewarm_fn=warm, max_unread_outputs=100, max_unread_bytes=KIB
    ) as orch:
        async with orch.open_request("p", request_id="r") as stream:
            for _ in range(3):
                stage.emit_nowait("r", b"0123456789")
            await fw.settle()
            batch = await stream.receive_batch()
            assert len(batch) == 3
            assert orch.statistics().unread_bytes == (30,)  # being written, say
            stage.emit_nowait("r", b"!", finished=True)
            await fw.settle()
            assert [o.data for o in await stream.receive_batch()] == [b"!"]
            assert orch.statistics().unread_bytes == (1,)  # the terminal, in hand
        assert orch.statistics().unread_requests == 0


@both
async def test_the_shared_queue_counts_per_request(fw):
    stage = fw.ScriptedStage(takes_credit=True)
    async with fw.open_orchestrator(
        [stage], {0}, prewarm_fn=warm, max_unread_outputs=4, max_unread_bytes=KIB
    ) as orch:
        await orch.add_request("a", "p")
        await orch.add_request("b", "p")
        for _ in range(2):
            stage.emit_nowait("a", "aa")
            stage.emit_nowait("b", "b")
        await fw.settle()
        assert orch.statistics().unread_bytes == (6,)
        taken = [await orch.next_output() for _ in range(4)]
        assert [o.request_id for o in taken] == ["a", "b", "a", "b"]
        assert orch.statistics().unread_outputs == (0,)
        await stage.emit("a", "more")  # settled when more comes (or the consumer waits)
        await fw.settle()
        assert stage.granted("a") == (6, KIB + 4)
        assert stage.granted("b") == (6, KIB + 2)


@both
async def test_an_output_left_unread_ends_its_request_at_the_idle_timeout(fw):
    stages = [fw.ScriptedStage(takes_credit=True) for _ in range(2)]
    async with fw.open_orchestrator(
        stages, {0, 1}, prewarm_fn=warm, consumer_idle_timeout=30
    ) as orch:
        async with orch.open_request("p", request_id="r") as stream:
            await fw.sleep(100)  # the stages are slow, nothing waits: not idle
            await stages[0].emit("r", "unread")
            await stages[1].emit("r", b"audio")
            await fw.sleep(29)
            assert orch.statistics().in_flight == 1
            await fw.sleep(2)
            assert orch.statistics().in_flight == 0
            assert [(await stream.receive()).data for _ in range(2)] == ["unread", b"audio"]
            terminal = await stream.receive()
            assert terminal.finished
            assert terminal.finish_reason == "error"
            assert terminal.error == (
                "its consumer left an output unread for 30 s (consumer_idle_timeout)"
            )
            assert terminal.metrics.e2e_latency == 130
        await fw.settle()
        assert [s.aborts for s in stages] == [["r"], ["r"]]
        assert orch.statistics().unread_requests == 0


@both
async def test_no_idle_timeout_with_zero_and_no_idleness_for_a_slow_producer(fw):
    stage = fw.ScriptedStage(takes_credit=True)
    async with fw.open_orchestrator([stage], {0}, prewarm_fn=warm, consumer_idle_timeout=0) as orch:
        await orch.add_request("r", "p")
        await stage.emit("r", "x")
        await fw.sleep(10_000)
        assert orch.statistics().in_flight == 1
    stage = fw.ScriptedStage(takes_credit=True)
    async with fw.open_orchestrator([stage], {0}, prewarm_fn=warm, consumer_idle_timeout=5) as orch:

        async def slowly():
            for _ in range(3):
                await fw.sleep(60)  # the stage is slow; its consumer reads at once
                await stage.emit("r", "tok")
            await stage.emit("r", None, finished=True)

        async with orch.open_request("p", request_id="r") as stream, fw.open_tasks() as tasks:
            tasks.start_soon(slowly)
            outs = [o async for o in stream]
            assert [o.data for o in outs] == ["tok"] * 3 + [None]
            assert outs[-1].finish_reason == "completed"


@both
async def test_the_shared_queue_drops_only_the_idle_requests_outputs(fw):
    stage = fw.ScriptedStage()
    async with fw.open_orchestrator([stage], {0}, prewarm_fn=warm, consumer_idle_timeout=5) as orch:
        await orch.add_request("idle", "p")
        await stage.emit("idle", "never read")
        await fw.sleep(3)
        await orch.add_request("busy", "p")
        await stage.emit("busy", "b1")
        await fw.sleep(2.5)  # "idle" times out; "busy"'s output waited 2.5 s
        assert (await orch.next_output()).data == "never read"
        assert (await orch.next_output()).data == "b1"
        ended = await orch.next_output()
        assert (ended.request_id, ended.finish_reason) == ("idle", "error")
        await stage.emit("busy", "b2", finished=True)
        assert (await orch.next_output()).finish_reason == "completed"


@both
async def test_forward_mode_bounds_what_it_collects_for_the_next_stage(fw):
    stages = [fw.ScriptedStage() for _ in range(2)]
    stages[0].name = "thinker"
    async with fw.open_orchestrator(
        stages, {1}, forward_fn=join_forward, max_forward_bytes=10
    ) as orch:
        await orch.add_request("ok", "p")
        await orch.add_request("big", "p")
        await stages[0].emit("ok", "0123456789", finished=True)
        await stages[0].emit("big", "01234")
        await stages[0].emit("big", b"567890")
        outs = await fw.collect_outputs(orch)
        assert outs[0].request_id == "big"
        assert outs[0].error == (
            "stage 0 (thinker) sent more than 10 bytes for the next stage's input "
            "(max_forward_bytes)"
        )
        assert stages[1].submitted_ids() == ["ok"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_unread_bytes", 0),
        ("max_unread_outputs", -1),
        ("max_forward_bytes", 1.5),
        ("consumer_idle_timeout", -1),
    ],
)
@both
async def test_bad_bounds_are_refused_by_name(fw, name, value):
    stages = [fw.ScriptedStage()]
    with pytest.raises(ValueError, match=name):
        async with fw.open_orchestrator(stages, {0}, prewarm_fn=warm, **{name: value}):
            pass


# -- real workers -------------------------------------------------------------------------

HELD = {"max_unread_outputs": 32, "max_unread_bytes": 20_000, "consumer_idle_timeout": 0}


@pytest.mark.parametrize("async_chunk", [False, True], ids=["forward", "async_chunk"])
async def test_a_stream_that_stops_reading_holds_its_engines_and_no_others(async_chunk):
    """A request whose consumer reads one output and stops: its final stage's engine
    is held at the bound (in async_chunk mode, its upstream through the link window),
    while 10 other requests on the same stages complete."""
    if async_chunk:
        stages = [("counts", "{ size = 1000 }", False, ""), ("relay", "{}", True, "")]
    else:
        stages = [("counts", "{ size = 1000 }", True, "")]
    config = pipeline_config(*stages, async_chunk=async_chunk)
    async with running(config, **HELD) as (_, orch):
        async with orch.open_request(-1, request_id="stuck") as stuck:
            await stuck.receive()  # it runs; then its consumer reads nothing more
            for _ in range(3):
                await trio.sleep(0.2)
                stats = orch.statistics()
                assert 0 < stats.total_unread_bytes <= HELD["max_unread_bytes"]
                assert stats.total_unread_outputs <= HELD["max_unread_outputs"]

            async def other(number):
                async with orch.open_request(200, request_id=f"r{number}") as stream:
                    outs = [o async for o in stream]
                assert outs[-1].finish_reason == "completed"
                assert len(outs) == 201

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for number in range(10):
                        nursery.start_soon(other, number)
            stats = orch.statistics()
            assert stats.in_flight == 1  # the stuck one, held, not failed
            assert stats.total_unread_bytes <= HELD["max_unread_bytes"]
        stats = orch.statistics()
        assert (stats.in_flight, stats.unread_requests, stats.total_unread_outputs) == (0, 0, 0)
