"""The connector, the data plane's coordinator: which workers it tells where their
readers are (``route``), when a reading stage's worker comes, goes, and is gone for
good; and what it counts. Fake worker connections record the routes they are sent;
one test runs real (in-process) workers."""

from __future__ import annotations

import msgspec
import pytest
import trio

from omni_trio import StageRequest
from omni_trio.process import WorkerOptions, open_inprocess_stage, open_shm_connector
from omni_trio.process._options import MAX_WINDOW, MIN_RING_BYTES, WINDOW, WINDOW_BYTES
from omni_trio.process.worker import _shm
from processes import eventually, pipeline_config, running


class FakeWorker:
    """A ``WorkerConnection`` as the connector uses it: its address, its routes, its
    last report (none yet)."""

    def __init__(self, address: str = "") -> None:
        self.address = address
        self.routes: list[tuple[int, str, bool]] = []
        self.report = None

    def route(self, stage_id: int, address: str, *, gone: bool = False, replica: int = 0) -> None:
        self.routes.append(
            (stage_id, address, gone) if not replica else (stage_id, address, gone, replica)
        )

    def taken(self) -> list[tuple[int, str, bool]]:
        """The routes sent since the last call."""
        routes, self.routes = self.routes, []
        return routes


async def test_senders_learn_where_their_readers_are_whichever_starts_first():
    async with open_shm_connector({0: [1], 1: [2]}) as connector:
        thinker, talker, code2wav = FakeWorker(), FakeWorker("\0t"), FakeWorker("\0c")
        connector.attach(0, thinker)
        assert thinker.taken() == [(1, "", False)]  # no reader yet: wait for one
        connector.attach(1, talker)
        assert thinker.taken() == [(1, "\0t", False)]
        assert talker.taken() == [(2, "", False)]
        connector.attach(2, code2wav)
        assert talker.taken() == [(2, "\0c", False)]
        assert (thinker.taken(), code2wav.taken()) == ([], [])  # stage 2 sends nothing
        stats = connector.statistics()
        assert (stats.workers_attached, stats.routes_sent) == (3, 4)


async def test_a_readers_restart_makes_its_senders_wait_then_follow_it():
    async with open_shm_connector({0: [1]}) as connector:
        thinker = FakeWorker()
        connector.attach(1, FakeWorker("\0first"))
        connector.attach(0, thinker)
        assert thinker.taken() == [(1, "\0first", False)]
        connector.detach(1)  # it died: wait for the next one
        assert thinker.taken() == [(1, "", False)]
        connector.detach(1)  # already gone: nothing to say
        assert thinker.taken() == []
        connector.attach(1, FakeWorker("\0second"))
        assert thinker.taken() == [(1, "\0second", False)]
        assert connector.statistics().workers_attached == 2


async def test_a_senders_restart_learns_where_its_readers_are():
    async with open_shm_connector({0: [1]}) as connector:
        connector.attach(1, FakeWorker("\0reader"))
        connector.attach(0, FakeWorker())
        connector.detach(0)  # no reader is told anything: a sender's loss is theirs
        replacement = FakeWorker()
        connector.attach(0, replacement)
        assert replacement.taken() == [(1, "\0reader", False)]


async def test_a_reader_gone_for_good_has_its_chunks_dropped():
    async with open_shm_connector({0: [1]}) as connector:
        thinker = FakeWorker()
        connector.attach(1, FakeWorker("\0reader"))
        connector.attach(0, thinker)
        thinker.taken()
        connector.close(1)
        assert thinker.taken() == [(1, "", True)]
        replacement = FakeWorker()  # a sender that restarts later hears it too
        connector.detach(0)
        connector.attach(0, replacement)
        assert replacement.taken() == [(1, "", True)]
        assert connector.statistics().workers_attached == 1


async def test_every_edge_is_routed_fan_out_and_fan_in():
    async with open_shm_connector({0: [1, 2], 1: [2]}) as connector:
        assert connector.targets(0) == (1, 2)
        assert connector.targets(2) == ()
        assert [connector.reads(stage) for stage in range(3)] == [False, True, True]
        thinker, talker = FakeWorker(), FakeWorker("\0t")
        connector.attach(0, thinker)
        connector.attach(1, talker)
        assert thinker.taken() == [(1, "", False), (2, "", False), (1, "\0t", False)]
        assert talker.taken() == [(2, "", False)]
        connector.attach(2, FakeWorker("\0c"))  # read by both
        assert thinker.taken() == [(2, "\0c", False)]
        assert talker.taken() == [(2, "\0c", False)]


async def test_leaving_the_block_forgets_every_worker_and_sweeps_the_prefix():
    async with open_shm_connector({0: [1]}) as connector:
        thinker = FakeWorker()
        connector.attach(0, thinker)
        connector.attach(1, FakeWorker("\0reader"))
        thinker.taken()
        ring = trio.Path(_shm.SHM_DIR, f"{connector.prefix}-0-1-ring1-1")
        await ring.write_bytes(bytes(4096))  # as a dead worker's ring would be left
        stats = connector.statistics()
        assert (stats.segments_live, stats.shm_bytes) == (1, 4096)
    assert connector.statistics().workers_attached == 0
    assert _shm.listing(connector.prefix) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inline_chunk_bytes": -1}, "inline_chunk_bytes must be >= 0, got -1"),
        ({"ring_bytes": MIN_RING_BYTES - 1}, f"ring_bytes must be >= {MIN_RING_BYTES}, got"),
        ({"window": 0}, f"window must be an integer from 1 to {MAX_WINDOW}, got 0"),
        ({"window": MAX_WINDOW + 1}, f"window must be an integer from 1 to {MAX_WINDOW}, got"),
        ({"window": 2.0}, "window must be an integer from 1 to"),
        ({"window_bytes": 0}, "window_bytes must be an integer >= 1, got 0"),
    ],
)
async def test_sizes_out_of_range_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        async with open_shm_connector({0: [1]}, **kwargs):
            pytest.fail("must not open")  # pragma: no cover


async def test_real_workers_are_routed_again_when_a_reader_restarts():
    """In-process workers: attached when ready, the reader's restart routes its
    sender twice (wait, then the new address), and chunks flow again after it."""
    options = WorkerOptions(restart=True)
    with trio.fail_after(20):
        async with (
            open_shm_connector({0: [1]}) as connector,
            open_inprocess_stage(
                "process_engines:stream", engine_args={"count": 3}, connector=connector
            ) as thinker,
            open_inprocess_stage(
                "process_engines:relay", stage_id=1, connector=connector, options=options
            ) as talker,
        ):
            stats = connector.statistics()
            assert (stats.workers_attached, stats.routes_sent) == (2, 2)
            talker.kill()
            await eventually(lambda: talker.statistics().restarts == 1)
            await eventually(lambda: connector.statistics().workers_attached == 2)
            assert connector.statistics().routes_sent == 4
            request = StageRequest("r", "r")  # one admission: one life at both stages
            await talker.submit(msgspec.structs.replace(request, inputs=None))
            await thinker.submit(request)
            outs = []
            while not (outs and outs[-1].finished):
                item = await talker.outputs.receive()
                outs += item if isinstance(item, list) else [item]
            assert [o.data for o in outs] == ["R:0:0", "R:0:1", "R:0:2", None]
            await thinker.release("r")
            await talker.release("r")


async def test_the_connector_knows_the_window_and_each_stage_its_senders_wait_for():
    async with open_shm_connector({0: [1, 2]}) as connector:
        assert (connector.window, connector.window_bytes) == (WINDOW, WINDOW_BYTES)
        connector.add_stage(1, "stage 1 (talker)", 5.0)
        assert connector.target_labels(0) == {1: "stage 1 (talker)", 2: "stage 2"}
        default = WorkerOptions().startup_timeout
        assert connector.target_startup_timeouts(0) == {1: 5.0, 2: default}
        assert connector.target_labels(1) == {}
    async with open_shm_connector({0: [1]}, window=3, window_bytes=100) as connector:
        assert (connector.window, connector.window_bytes) == (3, 100)


INPROCESS = '[stages.runtime]\nbackend = "inprocess"'


@pytest.mark.parametrize(
    ("keys", "size", "held_at"),
    [({"window": 3}, 64, 3), ({"window_bytes": 2500}, 1000, 2)],
    ids=["window", "window_bytes"],
)
async def test_the_configs_window_reaches_the_workers(tmp_path, keys, size, held_at):
    """``[pipeline] window`` and ``window_bytes``: a request whose reader does not
    read stops after that many chunks (or bytes of inline chunks); in-process stages."""
    gate = tmp_path / "never"
    config = pipeline_config(
        ("sends", f"{{ sizes = [{size}], repeat = 20, start = 0.1 }}", True, INPROCESS),
        ("reads", f'{{ gate = "{gate}" }}', True, INPROCESS),
        **keys,
    )
    async with running(config) as (pipeline, orch):
        connector = pipeline.connector
        expected = {"window": WINDOW, "window_bytes": WINDOW_BYTES, **keys}
        assert (connector.window, connector.window_bytes) == tuple(expected.values())
        async with orch.open_request("p", request_id="held") as stream:
            progress = []
            with trio.move_on_after(0.5):  # long enough to send them all, unheld
                async for out in stream:
                    if out.stage_id == 0 and out.data is not None:
                        progress.append(out.data)
            assert progress == list(range(1, held_at + 1))
