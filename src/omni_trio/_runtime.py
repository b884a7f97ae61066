"""Running a command's async main under SIGINT and SIGTERM, the way a command should.

:func:`run_under_signals` is :func:`trio.run` for a command line (``omni-trio demo``,
``omni-trio run``, a server): it takes the two stop signals itself, with
:func:`trio.open_signal_receiver`, and turns them into Trio cancellation:

- **SIGINT** (Ctrl-C, or a second signal of either kind during a graceful stop)
  cancels the main function at once. Cancellation is how everything ends cleanly:
  each ``async with`` block exits as it would on any cancellation -- every request
  gets its ``"aborted"`` terminal, every worker is told to stop and is reaped, every
  shared-memory segment is freed (all of which is shielded and bounded by its own
  grace). Then one line, ``interrupted``, goes to stderr and the process exits with
  status 130 (128 + SIGINT, as a shell reports a job killed by Ctrl-C). More Ctrl-C
  while that cleanup runs changes nothing: it is bounded already.
- **SIGTERM** asks for a graceful stop: the ``stopping`` event handed to the main
  function is set, the main function stops admitting new work and lets what is in
  flight finish; whatever is still running ``grace`` seconds later is cancelled. The
  exit status is 0 either way -- a service manager's SIGTERM is an order to stop, not
  a failure. If the main function returns within the grace, its value is returned
  as usual (a command may print what it finished).

An error the main function raises after a stop signal is most likely the signal's
doing -- the signal reached the whole process group, and a worker that was still
starting may have died of it -- so it is said in one line on stderr, not as a
traceback, and the exit status is the signal's.

A ``KeyboardInterrupt`` outside the signal receiver's reach (while the event loop
starts or ends, or -- with :func:`exits_on_interrupt` -- anywhere in a command,
imports included) ends the same way, ``interrupted`` and status 130, with no
traceback.

The same wrapper serves a server's drain-on-SIGTERM: it waits on ``stopping`` to close
its listener, and lets the open requests finish within its ``shutdown_grace``.
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Generic, NoReturn, ParamSpec, TypeVar

from ._errors import unwrap_single_exception
from ._util import describe

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    import trio

# trio is imported where it is used: the command line imports this module at its
# start, and a command that runs no event loop (``--help``) need not load one.

__all__ = [
    "DEFAULT_GRACE",
    "EXIT_INTERRUPTED",
    "exits_on_interrupt",
    "run_under_signals",
]

T = TypeVar("T")
P = ParamSpec("P")

#: The exit status after an interrupt: 128 + SIGINT, as shells report Ctrl-C.
EXIT_INTERRUPTED = 128 + signal.SIGINT
#: Seconds a graceful stop lets work in flight run before it is cancelled; the same
#: as ``open_orchestrator``'s and ``WorkerOptions``' ``shutdown_grace`` defaults.
DEFAULT_GRACE = 5.0


class _Ending(Generic[T]):
    """How the main function ended, as :func:`_supervise` saw it."""

    def __init__(self) -> None:
        self.value: T | None = None
        self.returned = False
        self.interrupted = False
        self.terminated = False  # a graceful stop was asked for
        self.grace_expired = False
        #: What ``main`` raised after a stop signal: most likely the signal's doing (a
        #: worker it reached as it started), said in one line, not as a traceback.
        self.casualty: BaseException | None = None

    @property
    def stopped(self) -> bool:
        return self.interrupted or self.terminated


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _interrupted() -> NoReturn:
    _say("interrupted")
    raise SystemExit(EXIT_INTERRUPTED)


def _only_keyboard_interrupts(group: BaseExceptionGroup[BaseException]) -> bool:
    matched, rest = group.split(KeyboardInterrupt)
    return matched is not None and rest is None


def run_under_signals(
    main: Callable[[trio.Event], Awaitable[T]], *, grace: float = DEFAULT_GRACE
) -> T:
    """Run ``main(stopping)`` in a new Trio run, stopping it on SIGINT or SIGTERM.

    ``stopping`` is a :class:`trio.Event`, set by the first SIGTERM: from then on
    ``main`` should admit no new work (check ``stopping.is_set()`` before each new
    request, or wait on ``await stopping.wait()`` to close a listener) and let what it
    admitted finish. ``grace`` seconds after that SIGTERM, whatever still runs in
    ``main`` is cancelled. A command that takes no new work can ignore ``stopping``::

        results = run_under_signals(functools.partial(run_demo, options, console))
        status = run_under_signals(lambda stopping: run_one(config, args))

    Must be called from the main thread, outside any Trio run.

    Returns:
      What ``main`` returned: it ran to its end, or it returned within the grace of a
      graceful stop.

    Raises:
      SystemExit: with status 130 after an interrupt (SIGINT, a second signal during
          a graceful stop, or a ``KeyboardInterrupt``), once ``interrupted`` is
          printed to stderr; with status 0 when the grace of a graceful stop ran out
          and ``main`` was cancelled (after one line on stderr saying so), or when
          ``main`` raised after the SIGTERM.
      ValueError: ``grace`` is not a number of seconds >= 0.
      Exception: whatever ``main`` raised before any stop signal, as it raised it.
    """
    import trio

    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise ValueError(f"grace must be a number of seconds >= 0, got {grace!r}")
    try:
        ending: _Ending[T] = trio.run(_supervise, main, float(grace))
    except KeyboardInterrupt:  # as the run started or ended, outside the receiver
        _interrupted()
    except BaseExceptionGroup as group:
        if _only_keyboard_interrupts(group):
            _interrupted()
        raise
    if ending.casualty is not None:
        _say(f"while stopping: {describe(ending.casualty)}")
    if ending.interrupted:
        _interrupted()
    if ending.grace_expired:
        _say(f"stopped: what still ran {grace:g} s after SIGTERM was cancelled")
    if not ending.returned:
        raise SystemExit(0)
    return ending.value  # type: ignore[return-value]


async def _supervise(main: Callable[[trio.Event], Awaitable[T]], grace: float) -> _Ending[T]:
    import trio

    ending: _Ending[T] = _Ending()
    stopping = trio.Event()
    main_scope = trio.CancelScope()
    # The receiver first, before anything starts: from here on a signal is a message.
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        unwrap_single_exception(),  # main's own exception, not a group of one
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch, signals, ending, stopping, main_scope, grace)
            with main_scope:
                try:
                    ending.value = await main(stopping)
                    ending.returned = True
                except BaseException as exc:
                    rest = _keep_casualty(exc, ending)
                    if rest is exc:
                        raise
                    if rest is not None:
                        raise rest from None  # the cancellation, which main_scope catches
            nursery.cancel_scope.cancel()
    if main_scope.cancelled_caught and not ending.interrupted:
        ending.grace_expired = True
    return ending


def _keep_casualty(exc: BaseException, ending: _Ending[T]) -> BaseException | None:
    """What of ``exc`` to re-raise: all of it, unless a stop signal came first; then
    its errors are kept as the casualty (the first one), and the rest (the
    cancellation) goes on."""
    if not ending.stopped:
        return exc
    if isinstance(exc, BaseExceptionGroup):
        errors, rest = exc.split(Exception)
        if errors is not None:
            first: BaseException = errors
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            ending.casualty = first
        return rest
    if isinstance(exc, Exception):
        ending.casualty = exc
        return None
    return exc


async def _watch(
    signals: AsyncIterator[int],
    ending: _Ending[T],
    stopping: trio.Event,
    main_scope: trio.CancelScope,
    grace: float,
) -> None:
    import trio

    async for signum in signals:
        if ending.interrupted:
            continue  # the cleanup is under way, shielded and bounded: let it end
        if signum == signal.SIGTERM and not ending.terminated:
            ending.terminated = True
            stopping.set()
            main_scope.deadline = min(main_scope.deadline, trio.current_time() + grace)
        else:  # SIGINT, or a second signal during a graceful stop
            ending.interrupted = True
            main_scope.cancel()


def exits_on_interrupt(function: Callable[P, T]) -> Callable[P, T]:
    """Decorate a command's entry point: a ``KeyboardInterrupt`` anywhere in it (say,
    while it imports, before any event loop runs) prints ``interrupted`` to stderr
    and exits with status 130, without a traceback."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return function(*args, **kwargs)
        except KeyboardInterrupt:
            _interrupted()
        except BaseExceptionGroup as group:
            if _only_keyboard_interrupts(group):
                _interrupted()
            raise

    return wrapper
