"""Flow control per request: what each request's consumer has not taken yet.

Sans-IO, shared by every driver (the Trio orchestrator, the asyncio twin and the
plain design pay for it alike). The handler :meth:`~FlowLedger.put`\\ s every output it
hands to a consumer; the consumer's side reports what it took (:meth:`~FlowLedger.read`)
-- a request's stream when its consumer comes back for more, so a batch still in
the consumer's hands (a response being written to a socket) counts as unread until
then; ``next_output()`` when it returns.

Each request may hold at most ``max_unread_outputs`` outputs and ``max_unread_bytes``
bytes unread (:func:`~omni_trio._util.output_size` counts: the length of ``bytes``
and ``str`` data, 0 for anything else). It is enforced with credit, as HTTP/2's flow
control is: each final stage of a request that has a ``credit`` method gets the
request's window (split evenly among its final stages) before its submit, spends it
on each output it sends, and gets back what the consumer took once that is half its
window (:class:`~omni_trio._core.StageCredit`). A stage out of credit holds that
request's engine, and no other.

The consumer's idleness is measured here too: an output that waited unread for
``consumer_idle_timeout`` seconds makes :meth:`FlowLedger.expire` name its request,
and the driver ends it with an error.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs

from ._util import output_size

if TYPE_CHECKING:
    from ._core import StageCredit
    from ._messages import OrchOutput

__all__ = [
    "CONSUMER_IDLE_TIMEOUT",
    "MAX_FORWARD_BYTES",
    "MAX_UNREAD_BYTES",
    "MAX_UNREAD_OUTPUTS",
    "FlowLedger",
    "FlowLimits",
]

#: Bytes of outputs a request may hold unread by its consumer (4 MiB).
MAX_UNREAD_BYTES = 4 * 1024 * 1024
#: Outputs a request may hold unread by its consumer.
MAX_UNREAD_OUTPUTS = 1024
#: Seconds an output may wait unread before its request ends with an error.
CONSUMER_IDLE_TIMEOUT = 60.0
#: Forward mode: bytes of one stage's outputs collected for the next stage (256 MiB).
MAX_FORWARD_BYTES = 256 * 1024 * 1024


@attrs.frozen
class FlowLimits:
    """A request's bounds on what its consumer may leave unread (checked by
    ``prepare``): ``open_orchestrator``'s arguments of these names."""

    max_unread_bytes: int = MAX_UNREAD_BYTES
    max_unread_outputs: int = MAX_UNREAD_OUTPUTS
    consumer_idle_timeout: float = CONSUMER_IDLE_TIMEOUT


class _Window:
    """One final stage's credit for one request: its share of the request's window,
    and what the consumer took since the stage last got credit back."""

    __slots__ = ("owed_bytes", "owed_outputs", "share_bytes", "share_outputs")

    def __init__(self, share_outputs: int, share_bytes: int) -> None:
        self.share_outputs = share_outputs
        self.share_bytes = share_bytes
        self.owed_outputs = 0
        self.owed_bytes = 0


class _Account:
    """One request's outputs that its consumer has not taken."""

    __slots__ = ("armed", "batches", "ended", "outputs", "stages", "windows")

    def __init__(self, windows: dict[int, _Window] | None) -> None:
        self.outputs = 0
        #: Per stage: ``[outputs, bytes]`` unread.
        self.stages: dict[int, list[int]] = {}
        self.ended = False  # its terminal was put: no more credit, no idleness
        self.windows = windows
        #: When each handler flush put outputs, and how many of those are unread
        #: (oldest first): the idle clock (only with a consumer_idle_timeout).
        self.batches: deque[list[float]] = deque()
        self.armed = False  # a timer of the ledger's heap may name it


class FlowLedger:
    """Every request's unread outputs, and the credit owed to its final stages.

    Args:
      num_stages: How many stages the pipeline has.
      limits: Each request's window, and how long an output may wait unread
          (``consumer_idle_timeout = 0``: forever).
      takes_credit: Per stage, whether it has a ``credit`` method.
      send_credit: Hands a :class:`~omni_trio._core.StageCredit` to its stage's
          delivery queue (never blocks; called from the consumer's side).
      credit: Builds a :class:`~omni_trio._core.StageCredit` (the core's command;
          passed in so this module imports nothing of the core).
    """

    def __init__(
        self,
        num_stages: int,
        limits: FlowLimits,
        *,
        takes_credit: Iterable[bool],
        send_credit: Callable[[StageCredit], None],
        credit: Callable[[int, str, int, int], StageCredit],
    ) -> None:
        self.limits = limits
        self.max_unread_outputs = limits.max_unread_outputs
        self.max_unread_bytes = limits.max_unread_bytes
        #: ``None``: no idle check.
        self.consumer_idle_timeout = limits.consumer_idle_timeout or None
        self._takes_credit = tuple(takes_credit)
        self._send_credit = send_credit
        self._credit = credit
        self._num_stages = num_stages
        self._accounts: dict[str, _Account] = {}
        self._timers: list[tuple[float, int, str]] = []  # (deadline, seq, request id)
        self._seq = 0

    def __len__(self) -> int:
        """Requests with an account: in flight, or ended with outputs unread."""
        return len(self._accounts)

    def unread(self) -> tuple[list[int], list[int]]:
        """Per stage: the outputs given to consumers and not taken, and their bytes."""
        outputs = [0] * self._num_stages
        nbytes = [0] * self._num_stages
        for account in self._accounts.values():
            for stage_id, (count, size) in account.stages.items():
                outputs[stage_id] += count
                nbytes[stage_id] += size
        return outputs, nbytes

    # -- the handler's side ---------------------------------------------------------------

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
        self._accounts[request_id] = _Account(windows or None)

    def first_credit(self, stage_id: int, request_id: str) -> StageCredit | None:
        """The credit to give stage ``stage_id`` before the request's submit: its whole
        window, if it is one of the request's final stages and takes credit."""
        account = self._accounts.get(request_id)
        if account is None or account.windows is None or account.ended:
            return None
        window = account.windows.get(stage_id)
        if window is None:
            return None
        return self._credit(stage_id, request_id, window.share_outputs, window.share_bytes)

    def put(self, output: OrchOutput, now: float) -> None:
        """The handler gave ``output`` to its consumer (at time ``now``)."""
        account = self._accounts.get(output.request_id)
        if account is None:
            return  # its stream's block was left: nobody counts it any more
        size = output_size(output.data)
        account.outputs += 1
        unread = account.stages.get(output.stage_id)
        if unread is None:
            account.stages[output.stage_id] = [1, size]
        else:
            unread[0] += 1
            unread[1] += size
        if output.finished:
            account.ended = True
            account.windows = None
            account.batches.clear()
        elif self.consumer_idle_timeout is not None:
            batches = account.batches
            if batches and batches[-1][0] == now:
                batches[-1][1] += 1
            else:
                batches.append([now, 1])
                if not account.armed:
                    account.armed = True
                    self._seq += 1
                    deadline = now + self.consumer_idle_timeout
                    heapq.heappush(self._timers, (deadline, self._seq, output.request_id))

    def end(self, request_id: str) -> None:
        """The request is ending (its terminal is on its way): no more credit for it."""
        account = self._accounts.get(request_id)
        if account is not None:
            account.ended = True
            account.windows = None
            account.batches.clear()

    def next_deadline(self) -> float | None:
        """When :meth:`expire` may next have work (``None``: no output waits)."""
        return self._timers[0][0] if self._timers else None

    def expire(self, now: float) -> list[str]:
        """The requests with an output unread for ``consumer_idle_timeout`` seconds
        at ``now`` (each named once; the driver ends them)."""
        timeout = self.consumer_idle_timeout
        timers = self._timers
        idle = []
        while timers and timers[0][0] <= now:
            _, _, request_id = heapq.heappop(timers)
            account = self._accounts.get(request_id)
            if account is None:
                continue
            if not account.batches:  # everything it had waiting was taken since
                account.armed = False
                continue
            assert timeout is not None
            deadline = account.batches[0][0] + timeout
            if deadline <= now:
                account.armed = False
                idle.append(request_id)
            else:  # the outputs that waited were taken, younger ones wait: re-arm
                self._seq += 1
                heapq.heappush(timers, (deadline, self._seq, request_id))
        return idle

    # -- the consumer's side --------------------------------------------------------------

    def read_one(self, output: OrchOutput) -> None:
        """The consumer took ``output`` (and is done with it)."""
        account = self._accounts.get(output.request_id)
        if account is not None:
            self._read(account, output)

    def read(self, outputs: Iterable[OrchOutput]) -> None:
        """The consumer took ``outputs`` (and is done with them)."""
        accounts = self._accounts
        for output in outputs:
            account = accounts.get(output.request_id)
            if account is not None:
                self._read(account, output)

    def _read(self, account: _Account, output: OrchOutput) -> None:
        size = output_size(output.data)
        stage_id = output.stage_id
        account.outputs -= 1
        unread = account.stages[stage_id]
        unread[0] -= 1
        unread[1] -= size
        batches = account.batches
        if batches:
            oldest = batches[0]
            oldest[1] -= 1
            if not oldest[1]:
                batches.popleft()
        windows = account.windows
        if windows is not None:
            window = windows.get(stage_id)
            if window is not None:
                window.owed_outputs += 1
                window.owed_bytes += size
                if (
                    window.owed_outputs * 2 >= window.share_outputs
                    or window.owed_bytes * 2 >= window.share_bytes
                ):
                    credit = self._credit(
                        stage_id, output.request_id, window.owed_outputs, window.owed_bytes
                    )
                    window.owed_outputs = window.owed_bytes = 0
                    self._send_credit(credit)
        elif account.ended and not account.outputs:
            self._accounts.pop(output.request_id, None)

    def forget(self, request_id: str) -> None:
        """Close the request's account, whatever it still counts: its stream's block
        was left, and nothing of it will be read."""
        self._accounts.pop(request_id, None)

    def discard(self, request_id: str, outputs: Iterable[OrchOutput]) -> None:
        """``outputs`` of the request will never be read (dropped, or skipped when its
        stream's block was left); with no credit for them."""
        account = self._accounts.get(request_id)
        if account is None:
            return
        account.windows = None  # no credit back for what nobody read
        for output in outputs:
            self._read(account, output)
