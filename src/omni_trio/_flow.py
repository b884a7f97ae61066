"""Flow control per request: what each request's consumer has not taken yet.

Sans-IO, shared by every driver (the Trio orchestrator, the asyncio twin and the
plain design pay for it alike). Every output the handler hands to a consumer counts
as *unread* until it is taken: from a request's stream (the batch or output its
consumer took last still counts, until it comes back for more: a response blocked
writing it to a socket has not read it), or from ``next_output()``'s queue. The
outboxes keep the count per flushed batch (:class:`omni_trio._sink.OutboxBase`), so
that taking an output costs nothing extra; this ledger turns what they settle into
credit, and watches the clock.

Each request may hold at most ``max_unread_outputs`` outputs and ``max_unread_bytes``
bytes unread (:func:`~omni_trio._util.output_size` counts: the length of ``bytes``
and ``str`` data, 0 for anything else). That is enforced with credit, as HTTP/2's
flow control is: each final stage of a request that has a ``credit`` method gets the
request's window (split evenly among its final stages) before its submit, spends it
on each output it sends, and gets back what the consumer took once that is half its
window (:class:`~omni_trio._core.StageCredit`). A stage out of credit holds that
request's engine, and no other.

An output that waited unread for ``consumer_idle_timeout`` seconds makes
:meth:`FlowLedger.expire` name its request, and the driver ends the request with an
error. A stage that is slow to produce is never idle: only an output waiting counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypeAlias

import attrs

from ._util import output_size

if TYPE_CHECKING:
    from ._core import StageCredit
    from ._messages import OrchOutput

__all__ = [
    "CONSUMER_IDLE_TIMEOUT",
    "MAX_UNREAD_BYTES",
    "MAX_UNREAD_OUTPUTS",
    "CountingOutbox",
    "FlowLedger",
    "FlowLimits",
    "Tally",
]

#: Bytes of outputs a request may hold unread by its consumer (4 MiB).
MAX_UNREAD_BYTES = 4 * 1024 * 1024
#: Outputs a request may hold unread by its consumer.
MAX_UNREAD_OUTPUTS = 1024
#: Seconds an output may wait unread before its request ends with an error.
CONSUMER_IDLE_TIMEOUT = 60.0


Tally: TypeAlias = "dict[tuple[str, int], list[int]]"
"""What a flushed batch carries back as credit once taken: per (request, final stage
that takes credit), ``[outputs, bytes]``."""


@attrs.frozen
class FlowLimits:
    """A request's bounds on what its consumer may leave unread:
    ``open_orchestrator``'s arguments of these names (checked by ``prepare``)."""

    max_unread_bytes: int = MAX_UNREAD_BYTES
    max_unread_outputs: int = MAX_UNREAD_OUTPUTS
    consumer_idle_timeout: float = CONSUMER_IDLE_TIMEOUT


class CountingOutbox(Protocol):
    """What the ledger needs of an outbox that counts its consumer's unread outputs
    (:class:`omni_trio._sink.OutboxBase` is one: the outboxes use the ledger, and
    the ledger knows them by this alone)."""

    #: A stream's request id; ``""`` for ``next_output()``'s outbox.
    request_id: str

    def reconcile(self) -> None: ...

    def idle(self, now: float, timeout: float) -> tuple[list[str], float | None]: ...

    def disarm(self) -> None: ...

    def unread_outputs(self) -> list[OrchOutput]: ...


class _Window:
    """One final stage's credit for one request: its share of the request's window,
    and what the consumer took since the stage last got credit back."""

    __slots__ = ("owed_bytes", "owed_outputs", "share_bytes", "share_outputs")

    def __init__(self, share_outputs: int, share_bytes: int) -> None:
        self.share_outputs = share_outputs
        self.share_bytes = share_bytes
        self.owed_outputs = 0
        self.owed_bytes = 0


class FlowLedger:
    """Every request's account (its credit windows), the outboxes that count its
    unread outputs, and the idle clock.

    Args:
      num_stages: How many stages the pipeline has.
      limits: Each request's window, and how long an output may wait unread
          (``consumer_idle_timeout = 0``: forever).
      takes_credit: Per stage, whether it has a ``credit`` method.
      send_credit: Hands a :class:`~omni_trio._core.StageCredit` to its stage's
          delivery queue (never blocks; called from a consumer's side too).
      credit: Builds a :class:`~omni_trio._core.StageCredit` (the core's command;
          passed in so that this module imports nothing of the core).
      on_armed: Called when the idle clock gets a deadline while it had none (a
          driver's clock task waits for it; later deadlines are never earlier).

    Attributes:
      now: The driver's clock, as of its last handler step (a flushed batch's time).
    """

    def __init__(
        self,
        num_stages: int,
        limits: FlowLimits,
        *,
        takes_credit: Iterable[bool],
        send_credit: Callable[[StageCredit], None],
        credit: Callable[[int, str, int, int], StageCredit],
        on_armed: Callable[[], None] = lambda: None,
    ) -> None:
        self.max_unread_outputs = limits.max_unread_outputs
        self.max_unread_bytes = limits.max_unread_bytes
        #: ``None``: no idle check.
        self.consumer_idle_timeout = limits.consumer_idle_timeout or None
        self.now = 0.0
        self._num_stages = num_stages
        self._takes_credit = tuple(takes_credit)
        self._send_credit = send_credit
        self._credit = credit
        self._on_armed = on_armed
        #: Per request admitted and not yet settled: its credit windows (``None``:
        #: none, or no more: its terminal is out).
        self._accounts: dict[str, dict[int, _Window] | None] = {}
        #: Requests with credit windows (0: no batch needs a tally).
        self.credited = 0
        self._outboxes: dict[int, CountingOutbox] = {}  # by id(): every outbox counting
        self._timers: list[tuple[float, int, CountingOutbox]] = []  # (deadline, seq, outbox)
        self._seq = 0

    def __len__(self) -> int:
        """Requests with an account: in flight, or ended with outputs unread."""
        return len(self._accounts)

    # -- accounts -------------------------------------------------------------------------

    def attach(self, outbox: CountingOutbox) -> None:
        """Count ``outbox``'s unread outputs (``next_output()``'s, a stream's)."""
        self._outboxes[id(outbox)] = outbox

    def open(self, request_id: str, finals: frozenset[int]) -> None:
        """A request is admitted with final stages ``finals``: open its account."""
        shared = len(finals)
        windows = {
            stage_id: _Window(
                max(1, self.max_unread_outputs // shared), max(1, self.max_unread_bytes // shared)
            )
            for stage_id in finals
            if self._takes_credit[stage_id]
        }
        self._drop_windows(request_id)
        self._accounts[request_id] = windows or None
        self.credited += bool(windows)

    def first_credit(self, stage_id: int, request_id: str) -> StageCredit | None:
        """The credit to give stage ``stage_id`` before the request's submit: its whole
        window, if it is one of the request's final stages and takes credit."""
        windows = self._accounts.get(request_id)
        window = None if windows is None else windows.get(stage_id)
        if window is None:
            return None
        return self._credit(stage_id, request_id, window.share_outputs, window.share_bytes)

    def end(self, request_id: str) -> None:
        """The request's terminal is out: no more credit for it (its account stays
        until its outputs are taken)."""
        self._drop_windows(request_id)
        if request_id in self._accounts:
            self._accounts[request_id] = None

    def forget(self, request_id: str, outbox: CountingOutbox | None = None) -> None:
        """Close the request's account (its terminal was taken, or its stream's block
        is over), and stop counting its stream's ``outbox``."""
        self._drop_windows(request_id)
        self._accounts.pop(request_id, None)
        if outbox is not None:
            self._outboxes.pop(id(outbox), None)

    def _drop_windows(self, request_id: str) -> None:
        if self._accounts.get(request_id) is not None:
            self.credited -= 1

    # -- what the consumers took ------------------------------------------------------------

    def tally(self, outbox: CountingOutbox, outputs: list[OrchOutput]) -> Tally | None:
        """What ``outputs``, flushed into ``outbox``, will give back as credit once its
        consumer has taken them (``None``: none of them takes credit -- the common
        case costs a check, not a loop)."""
        if not self.credited:
            return None
        accounts = self._accounts
        stream = outbox.request_id
        windows = accounts.get(stream) if stream else None
        if stream and windows is None:
            return None  # a stream whose request takes no credit (or no more)
        tally: Tally = {}
        for output in outputs:
            request_windows = windows if stream else accounts.get(output.request_id)
            if request_windows is not None and output.stage_id in request_windows:
                key = (output.request_id, output.stage_id)
                counts = tally.get(key)
                if counts is None:
                    counts = tally[key] = [0, 0]
                counts[0] += 1
                counts[1] += output_size(output.data)
        return tally or None

    def read(self, tally: Tally) -> None:
        """A consumer has taken a batch whose credit is ``tally``: give its stages
        the credit back, each once it owes half a window."""
        accounts = self._accounts
        for (request_id, stage_id), (outputs, nbytes) in tally.items():
            windows = accounts.get(request_id)
            window = None if windows is None else windows.get(stage_id)
            if window is None:
                continue  # it ended meanwhile: no more credit
            window.owed_outputs += outputs
            window.owed_bytes += nbytes
            if (
                window.owed_outputs * 2 >= window.share_outputs
                or window.owed_bytes * 2 >= window.share_bytes
            ):
                credit = self._credit(stage_id, request_id, window.owed_outputs, window.owed_bytes)
                window.owed_outputs = window.owed_bytes = 0
                self._send_credit(credit)

    # -- the idle clock ---------------------------------------------------------------------

    def arm(self, outbox: CountingOutbox, deadline: float) -> None:
        """Look at ``outbox`` at ``deadline`` (an output flushed into it may wait)."""
        self._seq += 1
        timers = self._timers
        if not timers:
            self._on_armed()
        heapq.heappush(timers, (deadline, self._seq, outbox))
        if len(timers) > 2 * len(self._outboxes) + 64:  # closed streams' timers: drop them
            self._timers = [entry for entry in timers if self._counts(entry[2])]
            heapq.heapify(self._timers)

    def _counts(self, outbox: CountingOutbox) -> bool:
        """Whether ``outbox`` is still counted (a stream's block is not over)."""
        return self._outboxes.get(id(outbox)) is outbox

    def next_deadline(self) -> float | None:
        """When :meth:`expire` may next have work (``None``: no output waits). A
        deadline armed later is never earlier than this one (each is a flush's time
        plus the timeout), so a clock that sleeps until it misses nothing."""
        return self._timers[0][0] if self._timers else None

    def expire(self, now: float) -> list[str]:
        """The requests with an output unread for ``consumer_idle_timeout`` seconds at
        ``now`` (each output makes its request named once; the driver ends those
        still in flight)."""
        timeout = self.consumer_idle_timeout
        idle: list[str] = []
        while self._timers and self._timers[0][0] <= now:  # (arm may rebuild the heap)
            _, _, outbox = heapq.heappop(self._timers)
            if not self._counts(outbox):
                continue
            assert timeout is not None
            names, again = outbox.idle(now, timeout)
            idle += names
            if again is None:
                outbox.disarm()
            else:
                self.arm(outbox, again + timeout)
        return idle

    # -- statistics ---------------------------------------------------------------------------

    def unread(self) -> tuple[list[int], list[int]]:
        """Per stage: the outputs given to consumers and not taken, and their bytes
        (after settling what was taken: read terminals close their accounts)."""
        outputs = [0] * self._num_stages
        nbytes = [0] * self._num_stages
        for outbox in list(self._outboxes.values()):
            outbox.reconcile()
        for outbox in self._outboxes.values():
            for output in outbox.unread_outputs():
                outputs[output.stage_id] += 1
                nbytes[output.stage_id] += output_size(output.data)
        return outputs, nbytes
