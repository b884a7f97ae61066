"""Trio's side of a priority queue: :class:`PrioritySlots`, a semaphore whose
waiters go by priority, aged (see :mod:`omni_trio._priority`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ._priority import DEFAULT_AGING_S, SlotTable, check_priority
from ._util import final

__all__ = ["PrioritySlots", "SlotsStatistics"]


@attrs.frozen
class SlotsStatistics:
    """A snapshot of :class:`PrioritySlots` (:meth:`PrioritySlots.statistics`).

    Attributes:
      total: Its slots.
      reserved: Of those, the ones kept for urgent requests.
      in_use: Slots held.
      waiting: Tasks waiting for one.
      waiting_by_priority: Of those, how many per priority (only the priorities
          that have some).
    """

    total: int
    reserved: int
    in_use: int
    waiting: int
    waiting_by_priority: dict[int, int]


@final
class PrioritySlots:
    """``total`` slots for tasks to hold, handed out by priority: a
    :class:`trio.Semaphore` whose waiters are ordered by their ``priority`` (lower
    first), aged by ``aging_s`` (a waiter gains one step of priority per
    ``aging_s`` seconds waited, so nothing starves), first come first served on a
    tie.

    ``reserved`` of the slots go only to requests of priority at or under
    ``reserved_for``: the others never fill the last ``reserved``, so an urgent
    request finds a slot free even while long low-priority work holds the rest.

    A freed slot is handed to the first waiter; a new task never takes one ahead of
    a waiter that may use it. A task cancelled while it waits holds nothing.

    Example::

        slots = PrioritySlots(4, reserved=1)
        async with slots.slot(request.priority):
            ...  # at most 4 at once; at most 3 of priority above -1
    """

    def __init__(
        self,
        total: int,
        *,
        reserved: int = 0,
        reserved_for: int = -1,
        aging_s: float | None = DEFAULT_AGING_S,
    ) -> None:
        self._table: SlotTable[trio.lowlevel.Task] = SlotTable(
            total, reserved=reserved, reserved_for=reserved_for, aging_s=aging_s
        )

    def __repr__(self) -> str:
        table = self._table
        return (
            f"<PrioritySlots {table.in_use}/{table.total} in use "
            f"({table.reserved} reserved), {table.waiting} waiting>"
        )

    @property
    def total(self) -> int:
        return self._table.total

    def available(self, priority: int = 0) -> bool:
        """Whether :meth:`acquire` at ``priority`` would take a slot without waiting
        (until the next checkpoint)."""
        return self._table.available(check_priority(priority))

    async def acquire(self, priority: int = 0) -> float:
        """Wait for a slot, at ``priority``; returns the seconds waited.

        Raises:
          ValueError: ``priority`` is not an integer in range.
        """
        check_priority(priority)
        table = self._table
        await trio.lowlevel.checkpoint_if_cancelled()
        if table.take(priority):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return 0.0
        arrived = trio.current_time()
        waiter = table.wait(trio.lowlevel.current_task(), priority, arrived)

        def abort(_: Any) -> trio.lowlevel.Abort:
            # Still waiting: it leaves, holding nothing. Handed a slot already (and
            # rescheduled): it holds the slot, and the cancellation comes next time.
            return (
                trio.lowlevel.Abort.SUCCEEDED
                if table.cancel(waiter)
                else trio.lowlevel.Abort.FAILED
            )

        await trio.lowlevel.wait_task_rescheduled(abort)
        return trio.current_time() - arrived

    def release(self) -> None:
        """Give a slot back (to the first waiter that may take it)."""
        for waiter in self._table.give_back():
            trio.lowlevel.reschedule(waiter.item)  # it holds the slot from here

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[float]:
        """Hold a slot for the block; ``as`` gives the seconds waited for it."""
        waited = await self.acquire(priority)
        try:
            yield waited
        finally:
            self.release()

    def statistics(self) -> SlotsStatistics:
        table = self._table
        return SlotsStatistics(
            total=table.total,
            reserved=table.reserved,
            in_use=table.in_use,
            waiting=table.waiting,
            waiting_by_priority=dict(Counter(w.priority for w in table.waiters())),
        )
