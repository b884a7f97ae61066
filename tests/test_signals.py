"""Ctrl-C and SIGTERM: the real ``omni-trio demo`` stopped by a signal to its process
group, as a terminal or a service manager sends it; the runtime that turns signals
into cancellation; workers that leave it to their orchestrator."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from rich.console import Console

import omni_trio
from omni_trio._runtime import EXIT_INTERRUPTED, exits_on_interrupt, run_under_signals
from omni_trio.demo.runner import DemoOptions, run_demo
from omni_trio.process import open_process_stage
from omni_trio.process.worker import _shm
from omni_trio.process.worker import _wire as wire
from omni_trio.process.worker._transport import listen_address
from processes import live_processes

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

SRC = str(Path(omni_trio.__file__).parents[1])
TESTS = str(Path(__file__).parent)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, TESTS, env.get("PYTHONPATH", "")])
    return env


def _default_sigint() -> None:
    # A non-interactive shell starts background jobs with SIGINT ignored, and an
    # ignored SIGINT is inherited: give the command the disposition a terminal would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _group(pgid: int) -> list[str]:
    """The live (not zombie) processes of process group ``pgid``: pid and command."""
    found = []
    for pid, _, group, cmdline in live_processes():
        if group == pgid:
            command = cmdline.replace(b"\0", b" ")[:120].decode(errors="replace")
            found.append(f"{pid}: {command}")
    return found


def _segments(pid: int) -> list[str]:
    """The shared-memory segments of the pipelines started by process ``pid``: their
    prefix is ``ot<pid hex><6 hex>`` (``_shm.new_prefix``); other processes' are not
    ours, even those of tests running beside this one."""
    pattern = re.compile(rf"ot{pid:x}[0-9a-f]{{6}}-")
    return [name for name in _shm.listing("ot") if pattern.match(name)]


class Demo:
    """``omni-trio demo`` in its own process group, its output collected as it comes."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.out = bytearray()
        self.err = bytearray()
        self._more = trio.Event()

    async def collect(self, stream: trio.abc.ReceiveStream, into: bytearray) -> None:
        async for data in stream:
            into += data
            self._more.set()
            self._more = trio.Event()

    async def printed(self, text: str) -> None:
        while text.encode() not in self.out:
            if self.process.poll() is not None:
                pytest.fail(f"the demo ended first ({self.process.returncode}): {self.text()}")
            with trio.move_on_after(0.1):
                await self._more.wait()

    def text(self) -> str:
        return (self.out + self.err).decode(errors="replace")


#: ``omni-trio demo``, its chunks all in shared-memory segments (its small chunks
#: would otherwise travel inside their notices): segments the stop must free.
_DEMO_IN_SEGMENTS = (
    "import sys; import omni_trio.demo.runner as r; template = r.template; "
    "r.template = lambda *a: template(*a).with_pipeline(inline_chunk_bytes=0); "
    "from omni_trio.cli import main; sys.exit(main())"
)


async def stop_the_demo(signum: int, tmp_path: Path) -> tuple[int, Demo, list[str]]:
    """Start a slow demo, wait until a request streams, send ``signum`` to its whole
    process group; return its exit status, what it printed, and its segments just
    before the signal."""
    command = [sys.executable, "-c", _DEMO_IN_SEGMENTS, "demo", "--mode", "async_chunk"]
    command += ["--concurrency", "2", "--requests", "20", "--tokens-per-second", "20"]
    command += ["--max-tokens", "30", "--output", str(tmp_path / "demo.wav")]
    command += ["--engines", "simulated", "--thinker", "simulated"]
    command += ["--timeline", str(tmp_path / "timeline.png")]
    process = await trio.lowlevel.open_process(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: the signal goes to it, not to us
        preexec_fn=_default_sigint,
        env=_env(),
        cwd=tmp_path,
    )
    demo = Demo(process)
    pgid = process.pid
    try:
        async with trio.open_nursery() as nursery:
            assert process.stdout is not None
            assert process.stderr is not None
            nursery.start_soon(demo.collect, process.stdout, demo.out)
            nursery.start_soon(demo.collect, process.stderr, demo.err)
            with trio.fail_after(60):  # a loaded machine starts three workers slowly
                await demo.printed("request 0 (async_chunk)")
                await demo.printed("The")  # its first words: requests are streaming
            before = _segments(process.pid)
            os.killpg(pgid, signum)
            with trio.fail_after(10):
                status = await process.wait()
    finally:
        if process.returncode is None:
            os.killpg(pgid, signal.SIGKILL)
            await process.wait()
    # Workers were reaped by the demo; their resource trackers exit once they see
    # their worker gone: give them a moment.
    with trio.move_on_after(5):
        while _group(pgid):  # noqa: ASYNC110 - other processes: nothing to wait on
            await trio.sleep(0.05)
    assert _group(pgid) == [], "processes of the demo's group outlived it"
    return status, demo, before


def check_quiet_stop(demo: Demo, before: list[str]) -> None:
    assert "Traceback" not in demo.text()
    assert len(demo.err.decode().splitlines()) <= 3, demo.err.decode()
    assert before, "the running demo had no segment: the check below would prove nothing"
    assert _segments(demo.process.pid) == []


async def test_ctrl_c_stops_the_demo_cleanly(tmp_path):
    status, demo, before = await stop_the_demo(signal.SIGINT, tmp_path)
    assert status == 130, demo.text()
    check_quiet_stop(demo, before)
    assert demo.err.decode() == "interrupted\n"


async def test_sigterm_lets_the_requests_in_flight_finish(tmp_path):
    status, demo, before = await stop_the_demo(signal.SIGTERM, tmp_path)
    assert status == 0, demo.text()
    check_quiet_stop(demo, before)
    assert demo.err.decode() == ""
    # The two requests in flight finished (and no other started): the table says so.
    row = re.search(r"async_chunk\s*│\s*2\s*│\s*(\d+)\s*│", demo.out.decode())
    assert row is not None, demo.text()
    assert row.group(1) == "2"
    assert (tmp_path / "demo.wav").stat().st_size > 44  # request 0's audio, whole


# -- the runtime, in this process ---------------------------------------------------------


def raise_signal(signum: int) -> None:
    """Send ``signum`` to this process (the runtime's receiver takes it)."""
    os.kill(os.getpid(), signum)


def test_sigint_cancels_main_and_exits_130(capsys):
    cleaned = []

    async def main(stopping: trio.Event) -> str:
        try:
            raise_signal(signal.SIGINT)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)  # a shielded cleanup runs to its end
                cleaned.append(stopping.is_set())
        return "not reached"

    with pytest.raises(SystemExit) as exited:
        run_under_signals(main)
    assert exited.value.code == EXIT_INTERRUPTED == 130
    assert cleaned == [False]  # an interrupt is no graceful stop
    assert capsys.readouterr().err == "interrupted\n"


def test_sigterm_asks_main_to_stop_and_its_value_comes_back(capsys):
    async def main(stopping: trio.Event) -> str:
        raise_signal(signal.SIGTERM)
        await stopping.wait()
        await trio.sleep(0.05)  # finishing what is in flight
        return "drained"

    assert run_under_signals(main, grace=5) == "drained"
    assert capsys.readouterr().err == ""


def test_sigterm_cancels_what_still_runs_after_the_grace(capsys):
    async def main(stopping: trio.Event) -> None:
        raise_signal(signal.SIGTERM)
        await trio.sleep_forever()  # ignores the request to stop

    with pytest.raises(SystemExit) as exited:
        run_under_signals(main, grace=0.1)
    assert exited.value.code == 0
    assert capsys.readouterr().err == (
        "stopped: what still ran 0.1 s after SIGTERM was cancelled\n"
    )


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_during_a_graceful_stop_interrupts(capsys, second):
    async def main(stopping: trio.Event) -> None:
        raise_signal(signal.SIGTERM)
        await stopping.wait()
        raise_signal(second)
        await trio.sleep_forever()

    with pytest.raises(SystemExit) as exited:
        run_under_signals(main, grace=30)
    assert exited.value.code == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_an_error_after_a_stop_signal_is_one_line(capsys):
    async def main(stopping: trio.Event) -> None:
        raise_signal(signal.SIGINT)
        try:
            await trio.sleep_forever()
        finally:
            raise RuntimeError("a worker died of the signal as it started")

    with pytest.raises(SystemExit) as exited:
        run_under_signals(main)
    assert exited.value.code == 130
    assert capsys.readouterr().err == (
        "while stopping: RuntimeError: a worker died of the signal as it started\ninterrupted\n"
    )


def test_an_error_without_a_signal_is_raised_as_it_is():
    async def main(stopping: trio.Event) -> None:
        await trio.lowlevel.checkpoint()
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):  # not a group of one
        run_under_signals(main)


def test_a_keyboard_interrupt_in_the_run_is_an_interrupt(capsys):
    async def main(stopping: trio.Event) -> None:
        raise KeyboardInterrupt  # as trio's own handler would, outside the receiver

    with pytest.raises(SystemExit) as exited:
        run_under_signals(main)
    assert exited.value.code == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize(
    "interrupt",
    [KeyboardInterrupt(), BaseExceptionGroup("in a nursery", [KeyboardInterrupt()])],
)
def test_a_keyboard_interrupt_outside_the_run_is_an_interrupt(capsys, interrupt):
    @exits_on_interrupt
    def command(argv: list[str]) -> int:
        raise interrupt

    with pytest.raises(SystemExit) as exited:
        command([])
    assert exited.value.code == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_other_errors_pass_through_the_entry_point():
    @exits_on_interrupt
    def command() -> int:
        raise BaseExceptionGroup("two", [ValueError("a"), KeyboardInterrupt()])

    with pytest.raises(BaseExceptionGroup):
        command()


@pytest.mark.parametrize("grace", [-1, float("nan"), True, "5"])
def test_the_grace_is_checked(grace):
    async def main(stopping: trio.Event) -> None:  # pragma: no cover - never runs
        pass

    with pytest.raises(ValueError, match="grace must be a number of seconds >= 0"):
        run_under_signals(main, grace=grace)


def test_signal_handlers_are_restored_after_the_run():
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    async def main(stopping: trio.Event) -> int:
        await trio.lowlevel.checkpoint()
        return 1

    assert run_under_signals(main) == 1
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


async def test_a_demo_asked_to_stop_starts_no_request(tmp_path):
    stopping = trio.Event()
    stopping.set()
    options = DemoOptions.quick(tmp_path / "x.wav")
    report = await run_demo(options, Console(quiet=True), stopping)
    assert report.results == []
    assert report.wav is None
    assert not (tmp_path / "x.wav").exists()


# -- workers ------------------------------------------------------------------------------


def _ignored_signals(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask & (1 << (n - 1))}
    raise AssertionError("no SigIgn line")  # pragma: no cover


async def test_a_stage_worker_ignores_the_stop_signals():
    async with open_process_stage("process_engines:stream") as stage:
        assert stage.pid is not None
        assert {signal.SIGINT, signal.SIGTERM} <= _ignored_signals(stage.pid)


def _start_worker(control: socket.socket) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "omni_trio.process.worker", "--control-fd"]
    command.append(str(control.fileno()))
    return subprocess.Popen(
        command,
        pass_fds=[control.fileno()],
        stderr=subprocess.PIPE,
        preexec_fn=_default_sigint,
        env=_env(),
    )


async def test_a_worker_leaves_quietly_when_its_orchestrator_goes_away():
    """Ctrl-C is not the worker's to act on; its control connection closing, even
    with frames of the worker's unread (a reset, not an end of stream), ends it with
    status 0 and nothing on stderr -- while it streams chunks into a full ring for a
    reader that reads none: it frees its ring as it leaves."""
    control, control_child = socket.socketpair()
    worker = _start_worker(control_child)
    control_child.close()
    prefix = _shm.new_prefix()
    reader = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link = None
    try:
        await reader.bind(listen_address(prefix, 1, 1))
        reader.listen(1)
        init = wire.Init(
            0,
            "s",
            "process_engines:stream",
            {"count": 10_000},
            prefix,
            chunks=True,
            targets=[1],
            ring_bytes=64 * 1024,
        )
        control.sendall(wire.encode(init))
        with trio.fail_after(30):
            first = await trio.to_thread.run_sync(control.recv, 1 << 16)
        assert wire.DECODE_FROM_WORKER.decode(first[4:]).__class__ is wire.Ready
        control.sendall(wire.encode(wire.Route(1, listen_address(prefix, 1, 1))))
        for number in range(4):
            control.sendall(wire.encode(wire.Submit(f"r{number}", "x")))
        with trio.fail_after(30):  # it streams: outputs and chunks pile up unread
            link, _ = await reader.accept()
            while not _shm.listing(prefix):  # noqa: ASYNC110 - another process
                await trio.sleep(0.01)
        worker.send_signal(signal.SIGINT)  # as a terminal's Ctrl-C would
        await trio.sleep(0.2)
        assert worker.poll() is None, "the worker died of a Ctrl-C"
        control.close()
        with trio.fail_after(10):
            status = await trio.to_thread.run_sync(worker.wait)
        assert worker.stderr is not None
        assert (status, worker.stderr.read().decode()) == (0, "")
        assert _shm.listing(prefix) == [], "it freed its ring as it left"
    finally:
        reader.close()
        if link is not None:
            link.close()
        if worker.poll() is None:  # pragma: no cover
            worker.kill()
            worker.wait()
        if worker.stderr is not None:
            worker.stderr.close()
        _shm.sweep(prefix)


async def test_a_worker_whose_orchestrator_leaves_before_init_exits_quietly():
    control, control_child = socket.socketpair()
    worker = _start_worker(control_child)
    control_child.close()
    control.close()
    try:
        with trio.fail_after(30):
            status = await trio.to_thread.run_sync(worker.wait)
        assert worker.stderr is not None
        assert (status, worker.stderr.read().decode()) == (0, "")
    finally:
        if worker.stderr is not None:
            worker.stderr.close()
