"""Cancellation scenarios, each run on asyncio and on Trio.

Every scenario is a small, runnable piece of orchestrator life -- a stage cleaning
up, a reader, a request task, a consumer leaving its stream -- written the natural
way in each framework. Running it yields an :class:`Outcome` per framework: a short
``verdict`` (compared across frameworks: same or different) and what was observed.
A scenario that runs orchestrators may run the plain asyncio design as well
(:attr:`Scenario.run_plain`, a third column): ``barge-in``, whose code is
:mod:`omni_trio.compare.barge_in`.
``EXPECTED`` records the documented verdicts, per Python version where asyncio's
behaviour changed; the test suite asserts them on every Python in the matrix, and
``omni-trio compare`` prints them side by side. ``docs/cancellation.md`` explains
each one.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio
import trio.lowlevel
import trio.testing

from . import barge_in
from .asyncio_testing import AsyncioScriptedStage, wait_all_tasks_blocked
from .frameworks import ASYNCIO, TRIO, Framework

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup, timeout
else:  # pragma: no cover - exercised by the 3.10 session
    from taskgroup import TaskGroup, timeout

# The public names; EXPECTED, EXPECTED_PLAIN, expected_plain_verdict and run_plain are
# ``omni-trio compare``'s own (docs/api.md, "What is not API").
__all__ = ["SCENARIOS", "Outcome", "Scenario", "expected_verdicts", "run_scenario"]


@attrs.frozen
class Outcome:
    """What one framework did: ``verdict`` is compared, ``detail`` explains."""

    verdict: str
    detail: str


@attrs.frozen
class Scenario:
    """A scenario's runs: ``run_asyncio`` and ``run_trio`` always; ``run_plain``, the
    plain asyncio design (:mod:`omni_trio.compare.plain_asyncio`), for a scenario
    that runs orchestrators and shows all three (its ``run_asyncio`` is the twin's)."""

    key: str
    title: str
    run_asyncio: Callable[[], Outcome]
    run_trio: Callable[[], Outcome]
    run_plain: Callable[[], Outcome] | None = None


#: Every scenario, in the order ``omni-trio compare`` runs them.
SCENARIOS: list[Scenario] = []


def _scenario(key: str, title: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Register ``<key>_asyncio`` then ``async def <key>_trio`` as one scenario."""

    def register(fn: Callable[[], Any]) -> Callable[[], Any]:
        if fn.__name__.endswith("_asyncio"):
            _pending[key] = fn
        else:
            asyncio_fn = _pending.pop(key)
            SCENARIOS.append(Scenario(key, title, _on(ASYNCIO, asyncio_fn), _on(TRIO, fn)))
        return fn

    return register


_pending: dict[str, Callable[[], Any]] = {}


def _on(fw: Framework, fn: Callable[[], Any]) -> Callable[[], Outcome]:
    """Coroutine functions run on a fresh loop in virtual time; plain ones as they are."""
    if not inspect.iscoroutinefunction(fn):
        return fn

    def run() -> Outcome:
        outcome: Outcome = fw.run(fn, virtual_time=True)
        return outcome

    return run


def run_scenario(scenario: Scenario) -> tuple[Outcome, Outcome]:
    """Run ``scenario`` on asyncio, then on Trio."""
    return scenario.run_asyncio(), scenario.run_trio()


def run_plain(scenario: Scenario) -> Outcome | None:
    """Run ``scenario`` on the plain asyncio design, if it has that third run."""
    return None if scenario.run_plain is None else scenario.run_plain()


# -- 1. a stage's cleanup await after cancellation --------------------------------------


class _Segments:
    """Shared memory a stage must give back: release() takes a moment (an IPC round trip)."""

    def __init__(self) -> None:
        self.released = False


@_scenario("cleanup-await", "A stage's cleanup `await` after cancellation")
async def cleanup_await_asyncio() -> Outcome:
    segments = _Segments()

    async def stage_worker() -> None:
        try:
            await asyncio.sleep(math.inf)  # streaming chunks...
        finally:
            await asyncio.sleep(0.01)  # release(): tell the connector, wait for the ack
            segments.released = True

    task = asyncio.create_task(stage_worker())
    await asyncio.sleep(1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if segments.released:
        return Outcome("cleanup completed", "the await in `finally` ran to the end")
    return Outcome("cleanup interrupted", "the await in `finally` was cancelled")


@_scenario("cleanup-await", "A stage's cleanup `await` after cancellation")
async def cleanup_await_trio() -> Outcome:
    plain, shielded = _Segments(), _Segments()

    async def stage_worker(segments: _Segments, shield: bool) -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=shield):
                await trio.sleep(0.01)
                segments.released = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage_worker, plain, False)
        nursery.start_soon(stage_worker, shielded, True)
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    if plain.released:
        return Outcome("cleanup completed", "the await in `finally` ran to the end")
    return Outcome(
        "cleanup interrupted",
        "Cancelled again at the first await in `finally`"
        + ("; under `CancelScope(shield=True)` it completes" if shielded.released else ""),
    )


# -- 2. a reader that swallows cancellation ---------------------------------------------


@_scenario("broad-except", "A reader swallows cancellation with a broad `except`")
async def broad_except_asyncio() -> Outcome:
    outputs: asyncio.Queue[int] = asyncio.Queue()
    read: list[int] = []

    async def reader() -> None:
        while len(read) < 3:
            try:
                read.append(await outputs.get())
            except BaseException:  # "never let the reader die"
                continue

    task = asyncio.create_task(reader())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    for item in range(3):
        outputs.put_nowait(item)
    await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled() and len(read) == 3:
        return Outcome(
            "reader keeps running",
            f"swallowed the cancel, went on to read {read}; task ended not cancelled",
        )
    return Outcome("reader stopped", f"read {read}; cancelled={task.cancelled()}")


@_scenario("broad-except", "A reader swallows cancellation with a broad `except`")
async def broad_except_trio() -> Outcome:
    send, outputs = trio.open_memory_channel[int](math.inf)
    read: list[int] = []
    swallowed = 0

    async def reader() -> None:
        nonlocal swallowed
        while len(read) < 3 and swallowed < 5:
            try:
                read.append(await outputs.receive())
            except BaseException:  # "never let the reader die"
                swallowed += 1
                continue

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
        for item in range(3):
            send.send_nowait(item)
    if len(read) == 3:
        return Outcome("reader keeps running", f"read {read}")
    return Outcome(
        "reader stopped",
        f"read {read}: Cancelled was raised again at each of its next {swallowed} "
        "receives (cancellation is level-triggered)",
    )


# -- 3. swallowed cancellation, then a TaskGroup child fails -----------------------------


@_scenario("swallow-then-group-error", "Swallowed cancel, then a TaskGroup child fails")
async def swallow_then_group_error_asyncio() -> Outcome:
    async def fail_soon() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("talker crashed")

    async def request_task() -> None:
        me = asyncio.current_task()
        assert me is not None
        me.cancel()  # e.g. a client disconnect that a broad except swallowed earlier
        try:  # noqa: SIM105 - spelled out: the swallowing is the scenario
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass  # swallowed WITHOUT uncancel()
        try:
            async with TaskGroup() as group:
                group.create_task(fail_soon())
        finally:
            await asyncio.sleep(0)  # cleanup on the way out: free the request's segments

    try:
        await asyncio.create_task(request_task())
    except asyncio.CancelledError as exc:
        return Outcome(
            "error lost",
            f"the caller got CancelledError; the {_group_text(exc.__context__)} is only "
            "its __context__",
        )
    except BaseException as exc:
        return Outcome("error reported", f"the caller got {_group_text(exc)}")
    return Outcome("no error", "the request task returned normally")  # pragma: no cover


def _group_text(exc: BaseException | None) -> str:
    if exc is None:
        return "nothing"
    inner = getattr(exc, "exceptions", ())
    names = ", ".join(type(e).__name__ for e in inner)
    return f"{type(exc).__name__}([{names}])" if inner else type(exc).__name__


@_scenario("swallow-then-group-error", "Swallowed cancel, then a TaskGroup child fails")
async def swallow_then_group_error_trio() -> Outcome:
    async def fail_soon() -> None:
        await trio.sleep(0.01)
        raise ValueError("talker crashed")

    outcome = Outcome("no error", "the request task returned normally")
    with trio.CancelScope() as scope:
        scope.cancel()
        try:  # noqa: SIM105 - spelled out: the swallowing is the scenario
            await trio.lowlevel.checkpoint()
        except trio.Cancelled:
            pass  # swallowed: but the scope is still cancelled
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail_soon)
        except BaseException as exc:
            outcome = Outcome("error reported", f"the nursery raised {_group_text(exc)}")
            raise
    if scope.cancelled_caught:
        return Outcome(
            "never raised",
            "the scope was still cancelled, so the child was cancelled at its first "
            "checkpoint: no ValueError was ever raised, nothing was lost",
        )
    return outcome


# -- 4. a request task cancelled before it starts ----------------------------------------


@_scenario("cancel-before-start", "A request task cancelled before it starts")
async def cancel_before_start_asyncio() -> Outcome:
    terminals: list[str] = []

    async def handle_request() -> None:
        try:
            await asyncio.sleep(math.inf)
        finally:
            terminals.append("aborted")  # the request's one terminal message

    task = asyncio.create_task(handle_request())
    task.cancel()  # e.g. the client went away in the same loop iteration
    await asyncio.gather(task, return_exceptions=True)
    if terminals:
        return Outcome("finally ran", "the task started, its `finally` sent the terminal")
    return Outcome(
        "finally never ran",
        "the coroutine never started: no `finally`, no terminal for the request",
    )


@_scenario("cancel-before-start", "A request task cancelled before it starts")
async def cancel_before_start_trio() -> Outcome:
    terminals: list[str] = []

    async def handle_request() -> None:
        try:
            await trio.sleep_forever()
        finally:
            terminals.append("aborted")

    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.cancel()
        nursery.start_soon(handle_request)
    if terminals:
        return Outcome(
            "finally ran",
            "the task started, got Cancelled at its first checkpoint, `finally` ran",
        )
    return Outcome("finally never ran", "no terminal")  # pragma: no cover


# -- 5. shielded finalization --------------------------------------------------------------


@_scenario("shield", "Shielded finalization")
async def shield_asyncio() -> Outcome:
    log: list[str] = []

    async def finalize() -> None:
        await asyncio.sleep(0.05)  # deliver the aborts
        log.append("finalized")

    async def request_task() -> None:
        try:
            await asyncio.sleep(math.inf)
        finally:
            await asyncio.shield(finalize())
            log.append("after shield")

    task = asyncio.create_task(request_task())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.01)
    task.cancel()  # a second cancel (shutdown) while finalizing
    await asyncio.gather(task, return_exceptions=True)
    at_exit = list(log)
    await asyncio.sleep(0.1)
    return Outcome(
        "orphaned",
        f"the task ended with {at_exit or 'nothing done'}; the shielded work went on "
        f"alone and finished later ({log}), or is cancelled if the loop ends first",
    )


@_scenario("shield", "Shielded finalization")
async def shield_trio() -> Outcome:
    log: list[str] = []

    async def request_task() -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.05)
                log.append("finalized")
            log.append("after shield")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request_task)
        await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return Outcome("waited", f"the nursery exited after {log}: the shield waits")


# -- 6. a cancelled put on a full buffer ------------------------------------------------------


@_scenario("cancelled-put", "A cancelled `put`/`send` on a full buffer")
async def cancelled_put_asyncio() -> Outcome:
    queue: asyncio.Queue[str] = asyncio.Queue(1)
    queue.put_nowait("chunk 1")
    task = asyncio.create_task(queue.put("chunk 2"))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    return Outcome(
        "item left out" if items == ["chunk 1"] else "item delivered",
        f"the queue holds {items}",
    )


@_scenario("cancelled-put", "A cancelled `put`/`send` on a full buffer")
async def cancelled_put_trio() -> Outcome:
    send, receive = trio.open_memory_channel[str](1)
    send.send_nowait("chunk 1")
    with trio.move_on_after(0.01):
        await send.send("chunk 2")
    items = []
    while True:
        try:
            items.append(receive.receive_nowait())
        except trio.WouldBlock:
            break
    return Outcome(
        "item left out" if items == ["chunk 1"] else "item delivered",
        f"the channel holds {items}",
    )


# -- 7. a timeout around spawned work -----------------------------------------------------


@_scenario("timeout-spawned", "A timeout around spawned work")
async def timeout_spawned_asyncio() -> Outcome:
    log: list[str] = []

    async def prewarm_stage() -> None:
        await asyncio.sleep(0.1)
        log.append("child finished")

    child = None
    try:
        async with timeout(0.01):
            child = asyncio.create_task(prewarm_stage())
            await asyncio.sleep(math.inf)
    except (TimeoutError, asyncio.TimeoutError):
        log.append("timed out")
    await asyncio.sleep(0.2)
    assert child is not None
    if "child finished" in log:
        return Outcome("child kept running", f"{log}: the timeout did not reach the child")
    return Outcome("child cancelled", f"{log}")


@_scenario("timeout-spawned", "A timeout around spawned work")
async def timeout_spawned_trio() -> Outcome:
    log: list[str] = []

    async def prewarm_stage() -> None:
        try:
            await trio.sleep(0.1)
            log.append("child finished")
        except trio.Cancelled:
            log.append("child cancelled")
            raise

    with trio.move_on_after(0.01):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prewarm_stage)
            await trio.sleep_forever()
    log.append("timed out")
    await trio.sleep(0.2)
    if "child finished" in log:  # pragma: no cover
        return Outcome("child kept running", f"{log}")
    return Outcome("child cancelled", f"{log}: the scope covers the nursery's children")


# -- 8. fire-and-forget at shutdown --------------------------------------------------------


@_scenario("fire-and-forget", "A fire-and-forget task at shutdown")
def fire_and_forget_asyncio() -> Outcome:
    log: list[str] = []

    async def release_later() -> None:
        try:
            await asyncio.sleep(0.01)
            log.append("released")
        finally:
            log.append("finally")

    async def serve() -> None:
        asyncio.create_task(release_later())  # noqa: RUF006 - the point of the scenario
        await asyncio.sleep(0)

    asyncio.run(serve())  # a real asyncio.run, with its shutdown
    if "released" in log:  # pragma: no cover
        return Outcome("work completed", f"{log}")
    return Outcome(
        "silently cancelled",
        f"asyncio.run cancelled it at shutdown: {log}, no warning, the release never happened",
    )


@_scenario("fire-and-forget", "A fire-and-forget task at shutdown")
async def fire_and_forget_trio() -> Outcome:
    log: list[str] = []

    async def release_later() -> None:
        await trio.sleep(0.01)
        log.append("released")

    async def serve() -> None:
        async with trio.open_nursery() as nursery:  # no task without a nursery
            nursery.start_soon(release_later)

    await serve()
    return Outcome(
        "work completed", f"{log}: a task cannot outlive its nursery, which waits for it"
    )


# -- 9. a timed-out receive racing a delivered item --------------------------------------


_WINDOWS = {
    "same-iteration": "when the item and the deadline are due in one loop iteration",
    "late-loop": "when the loop runs late past the deadline after the item arrived",
}


async def _asyncio_race(window: str, ack: bool) -> str:
    """One ``wait_for(get(), 1 ms)`` whose deadline races the item's arrival.

    ``same-iteration``: the put and the timeout are due in the same loop iteration,
    put first. ``late-loop``: the put's callback then blocks the loop past the
    deadline, so the consumer's wakeup is queued before the timer. With ``ack``, the
    get awaits once more after taking the item (a wrapper, a janus-style queue...).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str] = asyncio.Queue()
    deadline = loop.time() + 0.001

    async def get() -> str:
        item = await queue.get()
        if ack:
            await asyncio.sleep(0)  # e.g. acknowledge, or update a counter
        return item

    def put() -> None:
        queue.put_nowait("chunk")
        if window == "late-loop":
            loop.block(0.0002)  # type: ignore[attr-defined]

    loop.call_at(deadline - (0.0001 if window == "late-loop" else 0.0), put)
    try:
        await asyncio.wait_for(get(), 0.001)
    except (TimeoutError, asyncio.TimeoutError):
        return "kept" if queue.qsize() == 1 else "lost"
    return "kept"  # received


async def _race_losses(race: Callable[[str, bool], Awaitable[str]], ack: bool) -> list[str]:
    return [window for window in _WINDOWS if await race(window, ack) == "lost"]


def _race_outcome(plain: list[str], wrapped: list[str], receive: str, then: str) -> Outcome:
    def loses(windows: list[str]) -> str:
        return "loses it " + " and ".join(_WINDOWS[w] for w in windows) if windows else "keeps it"

    verdict = f"{receive} {loses(plain)}; {then} {loses(wrapped)}"
    return Outcome(
        verdict.replace(_WINDOWS["same-iteration"], "in one iteration").replace(
            _WINDOWS["late-loop"], "if the loop is late"
        ),
        f"a bare {receive} {loses(plain)}; a {then} that awaits again after taking the "
        f"item {loses(wrapped)}",
    )


@_scenario("timed-receive", "A timed-out receive racing a delivered item")
async def timed_receive_asyncio() -> Outcome:
    plain = await _race_losses(_asyncio_race, ack=False)
    wrapped = await _race_losses(_asyncio_race, ack=True)
    return _race_outcome(plain, wrapped, "get()", "get()+await")


async def _trio_race(ack: bool) -> str:
    """The Trio analogue: the item and the cancellation reach the consumer together.

    Trio has no loop iterations to be late in: the race is "the item was handed to
    the parked receiver, then its scope was cancelled, before it ran".
    """
    send, receive = trio.open_memory_channel[str](1)
    got: list[str] = []

    async def consumer(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            item = await receive.receive()
            if ack:
                await trio.lowlevel.checkpoint()
            got.append(item)

    async with trio.open_nursery() as nursery:
        scope = await nursery.start(consumer)
        await trio.testing.wait_all_tasks_blocked()
        send.send_nowait("chunk")  # hands the item to the parked receiver...
        scope.cancel()  # ...and cancels it before it runs: no checkpoint in between
    left = []
    while True:
        try:
            left.append(receive.receive_nowait())
        except trio.WouldBlock:
            break
    return "kept" if got or left else "lost"


@_scenario("timed-receive", "A timed-out receive racing a delivered item")
async def timed_receive_trio() -> Outcome:
    plain = await _trio_race(ack=False)
    wrapped = await _trio_race(ack=True)
    wrapped_text = "loses it once handed over" if wrapped == "lost" else "keeps it"
    return Outcome(
        f"receive() {'keeps' if plain == 'kept' else 'loses'} it; "
        f"receive()+checkpoint {wrapped_text}",
        "a cancelled receive() never takes the item: once handed over it is returned and "
        "the Cancelled comes at the next checkpoint, so a consumer that awaits again "
        f"before using the item {wrapped_text}",
    )


# -- 10. the consumer leaves a request's stream early -------------------------------------


def _warm(stage_id: int, prompt: Any) -> str:
    return f"warm{stage_id}"


@_scenario("consumer-leaves", "The consumer leaves a request's stream early")
async def consumer_leaves_asyncio() -> Outcome:
    from .asyncio_orchestrator import open_asyncio_orchestrator

    stages = [AsyncioScriptedStage() for _ in range(3)]
    async with open_asyncio_orchestrator(stages, {0, 2}, prewarm_fn=_warm) as orch:
        try:
            async with timeout(1.0), orch.open_request("hi", request_id="r") as stream:
                await stages[0].emit("r", "partial text")
                async for _ in stream:
                    pass  # the talker never answers: the timeout fires
        except (TimeoutError, asyncio.TimeoutError):
            pass
        await wait_all_tasks_blocked()
        aborted = [sid for sid, s in enumerate(stages) if s.aborts == ["r"]]
    return _abort_outcome(aborted)


@_scenario("consumer-leaves", "The consumer leaves a request's stream early")
async def consumer_leaves_trio() -> Outcome:
    from .. import open_orchestrator
    from ..testing import ScriptedStage

    stages = [ScriptedStage() for _ in range(3)]
    async with open_orchestrator(stages, {0, 2}, prewarm_fn=_warm) as orch:
        with trio.move_on_after(1.0):
            async with orch.open_request("hi", request_id="r") as stream:
                await stages[0].emit("r", "partial text")
                async for _ in stream:
                    pass
        await trio.testing.wait_all_tasks_blocked()
        aborted = [sid for sid, s in enumerate(stages) if s.aborts == ["r"]]
    return _abort_outcome(aborted)


def _abort_outcome(aborted: list[int]) -> Outcome:
    if aborted == [0, 1, 2]:
        return Outcome("abort reaches every stage", "stages 0, 1 and 2 got abort('r')")
    return Outcome("abort lost", f"only stages {aborted} got abort('r')")  # pragma: no cover


# -- 11. barge-in: the answer's consumer interrupted mid-stream, on three designs -------


def _barge_in(run: Callable[[], barge_in.BargeIn]) -> Callable[[], Outcome]:
    def outcome() -> Outcome:
        report = run()
        return Outcome(report.verdict(), report.detail())

    return outcome


SCENARIOS.append(
    Scenario(
        "barge-in",
        "Barge-in: the answer's consumer interrupted mid-stream",
        _barge_in(barge_in.on_asyncio_twin),
        _barge_in(barge_in.on_trio),
        run_plain=_barge_in(barge_in.on_asyncio_plain),
    )
)


# -- expectations -------------------------------------------------------------------------

_BARGED_IN = "no chunk after the barge-in; every stage aborted in 0 ms; nothing left"

# Per scenario: the asyncio verdict by Python version (the first entry whose version is
# <= the running one applies), and the Trio verdict.
EXPECTED: dict[str, tuple[list[tuple[tuple[int, int], str]], str]] = {
    "cleanup-await": ([((3, 10), "cleanup completed")], "cleanup interrupted"),
    "broad-except": ([((3, 10), "reader keeps running")], "reader stopped"),
    "swallow-then-group-error": (
        [((3, 13), "error lost"), ((3, 10), "error reported")],
        "never raised",
    ),
    "cancel-before-start": ([((3, 10), "finally never ran")], "finally ran"),
    "shield": ([((3, 10), "orphaned")], "waited"),
    "cancelled-put": ([((3, 10), "item left out")], "item left out"),
    "timeout-spawned": ([((3, 10), "child kept running")], "child cancelled"),
    "fire-and-forget": ([((3, 10), "silently cancelled")], "work completed"),
    "timed-receive": (
        [
            ((3, 12), "get() keeps it; get()+await loses it if the loop is late"),
            ((3, 10), "get() keeps it; get()+await loses it in one iteration"),
        ],
        "receive() keeps it; receive()+checkpoint loses it once handed over",
    ),
    "consumer-leaves": ([((3, 10), "abort reaches every stage")], "abort reaches every stage"),
    "barge-in": ([((3, 10), _BARGED_IN)], _BARGED_IN),
}

#: The plain asyncio design's verdict, by Python version, for the scenarios that run it.
EXPECTED_PLAIN: dict[str, list[tuple[tuple[int, int], str]]] = {
    "barge-in": [((3, 10), _BARGED_IN)],
}


def expected_verdicts(key: str, version: tuple[int, int] = sys.version_info[:2]) -> tuple[str, str]:
    """The documented ``(asyncio, trio)`` verdicts of scenario ``key`` on ``version``."""
    by_version, trio_verdict = EXPECTED[key]
    return _on_version(key, by_version, version), trio_verdict


def expected_plain_verdict(key: str, version: tuple[int, int] = sys.version_info[:2]) -> str | None:
    """The plain asyncio design's documented verdict of scenario ``key`` on ``version``
    (``None``: the scenario does not run it)."""
    by_version = EXPECTED_PLAIN.get(key)
    return None if by_version is None else _on_version(key, by_version, version)


def _on_version(
    key: str, by_version: list[tuple[tuple[int, int], str]], version: tuple[int, int]
) -> str:
    for since, verdict in by_version:
        if version >= since:
            return verdict
    raise LookupError(f"no expectation for {key} on Python {version}")  # pragma: no cover
