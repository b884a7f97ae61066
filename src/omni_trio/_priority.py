"""Priorities: what a request's number means at every queue on its route, and the
waiting list each queue keeps. No I/O: the drivers own the waiting.

A request's ``priority`` is an ``int``; lower runs earlier, as in vLLM. A waiter's
*rank* is its priority less one for every ``aging_s`` seconds it has waited, so a
request that waits long enough overtakes any newcomer: low-priority work always
finishes. Every waiter of one queue ages at the same rate, so the order between two
waiters never changes while they wait, and a rank can be computed once, at arrival::

    rank = priority + arrival / aging_s

A newcomer of priority ``p`` thus goes ahead of a waiter of priority ``q > p`` only if
it arrives within ``(q - p) * aging_s`` seconds of that waiter: a waiter is overtaken
for at most that long, whatever keeps arriving.

:class:`WaitList` is the ordered waiting list; :class:`SlotTable` counts a queue's
slots -- some perhaps reserved for urgent requests -- and says whom a freed slot goes
to. :class:`omni_trio.PrioritySlots` (Trio) and the asyncio twin's wait on them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Generic, TypeVar

import attrs

__all__ = [
    "DEFAULT_AGING_S",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "SlotTable",
    "WaitList",
    "Waiter",
    "check_aging",
    "check_priority",
    "rank",
]

T = TypeVar("T")

#: The lowest (most urgent) priority a request may have.
PRIORITY_MIN = -1000
#: The highest (least urgent) priority a request may have.
PRIORITY_MAX = 1000
#: Seconds of waiting that gain a request one step of priority.
DEFAULT_AGING_S = 1.0


def check_priority(value: object, name: str = "priority") -> int:
    """``value`` as a priority, or a ``ValueError`` naming ``name`` and the range.

    Raises:
      ValueError: not an ``int`` (``bool`` is not one), or outside
          ``PRIORITY_MIN..PRIORITY_MAX``.
    """
    if type(value) is not int or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(
            f"{name} must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX} "
            f"(lower runs earlier), got {value!r}"
        )
    return value


def check_aging(value: object, name: str = "priority_aging_s") -> float | None:
    """``value`` as an aging period: a positive number of seconds, or ``None`` (no
    aging: strict priority, first come first served within one).

    Raises:
      ValueError: not a positive finite number or ``None``.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value < float("inf")
    ):
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def rank(priority: int, arrival: float, aging_s: float | None) -> float:
    """A waiter's place in its queue: lower goes first. Constant while it waits
    (see the module's docstring)."""
    return float(priority) if aging_s is None else priority + arrival / aging_s


@attrs.define(eq=False, slots=True)
class Waiter(Generic[T]):
    """One entry of a :class:`WaitList`: what waits (``item``), at what priority,
    since when. ``waiting`` turns ``False`` when it is taken or removed."""

    item: T
    priority: int
    arrival: float
    rank: float
    seq: int
    waiting: bool = True

    def __lt__(self, other: Waiter[T]) -> bool:
        return (self.rank, self.seq) < (other.rank, other.seq)


class WaitList(Generic[T]):
    """Waiters in rank order (priority, aged; first come first served on a tie).

    ``remove`` is O(1) (the entry is skipped when it reaches the head); ``pop``
    O(log n). The heap holds ``(rank, seq, waiter)``: tuples compare in C, and
    ``seq`` is unique, so a waiter itself is never compared.
    """

    __slots__ = ("_aging_s", "_heap", "_seq", "count")

    def __init__(self, aging_s: float | None = DEFAULT_AGING_S) -> None:
        self._aging_s = check_aging(aging_s)
        self._heap: list[tuple[float, int, Waiter[T]]] = []
        self._seq = itertools.count()
        #: Waiters waiting (``len()`` says it too).
        self.count = 0

    @property
    def aging_s(self) -> float | None:
        return self._aging_s

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Waiter[T]]:
        """The live waiters, in no particular order."""
        return (waiter for _, _, waiter in self._heap if waiter.waiting)

    def push(self, item: T, priority: int, now: float) -> Waiter[T]:
        aging_s = self._aging_s
        # rank(), inlined: every waiting admission passes here
        place = float(priority) if aging_s is None else priority + now / aging_s
        seq = next(self._seq)
        waiter = Waiter(item, priority, now, place, seq)
        heapq.heappush(self._heap, (place, seq, waiter))
        self.count += 1
        return waiter

    def peek(self) -> Waiter[T] | None:
        """The first waiter, left waiting; ``None`` when none waits."""
        heap = self._heap
        while heap and not heap[0][2].waiting:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> Waiter[T]:
        """Take the first waiter. Raises ``IndexError`` when none waits."""
        waiter = self.peek()
        if waiter is None:
            raise IndexError("pop from an empty WaitList")
        heapq.heappop(self._heap)
        waiter.waiting = False
        self.count -= 1
        return waiter

    def remove(self, waiter: Waiter[T]) -> bool:
        """Stop ``waiter`` waiting; ``False`` if it was taken or removed already."""
        if not waiter.waiting:
            return False
        waiter.waiting = False
        self.count -= 1
        if not self.count:
            self._heap.clear()
        return True

    def last(self) -> Waiter[T] | None:
        """The waiter that would go last (O(n)): what an overload sheds first."""
        return max(self, key=lambda waiter: (waiter.rank, waiter.seq), default=None)


class SlotTable(Generic[T]):
    """``total`` slots, handed out by rank; the last ``reserved`` of them only to
    requests of priority at or under ``reserved_for`` (urgent ones).

    A reserved slot keeps an urgent request from waiting behind running low-priority
    work that holds a slot for long (a language model's generation): the others may
    fill only ``total - reserved`` slots. Which slot is reserved is not fixed: it is
    the count that is kept free. Urgency is the request's own priority, unaged.

    A waiter is handed its slot when it is freed (:meth:`give_back` names it); a new
    request never takes a slot ahead of waiters that may use it.
    """

    __slots__ = ("_rest", "_urgent", "in_use", "reserved", "reserved_for", "total")

    def __init__(
        self,
        total: int,
        *,
        reserved: int = 0,
        reserved_for: int = -1,
        aging_s: float | None = DEFAULT_AGING_S,
    ) -> None:
        if type(total) is not int or total < 1:
            raise ValueError(f"slots must be a positive integer, got {total!r}")
        if type(reserved) is not int or not 0 <= reserved < total:
            raise ValueError(
                f"reserved slots must be an integer from 0 to {total - 1} "
                f"(fewer than the {total} slots), got {reserved!r}"
            )
        self.total = total
        self.reserved = reserved
        self.reserved_for = check_priority(reserved_for, "reserved_for")
        self.in_use = 0
        self._urgent: WaitList[T] = WaitList(aging_s)
        self._rest: WaitList[T] = WaitList(aging_s)

    @property
    def waiting(self) -> int:
        return len(self._urgent) + len(self._rest)

    def waiters(self) -> Iterator[Waiter[T]]:
        """Every waiter, in no particular order."""
        yield from self._urgent
        yield from self._rest

    def urgent(self, priority: int) -> bool:
        """Whether a request of ``priority`` may take a reserved slot."""
        return priority <= self.reserved_for

    def available(self, priority: int) -> bool:
        """Whether a slot is free for ``priority`` with no waiter that could use it
        ahead: what :meth:`take` would take."""
        free = self.total - self.in_use
        if priority <= self.reserved_for:
            return free > 0 and not self._urgent.count
        return free > self.reserved and not self._urgent.count and not self._rest.count

    def take(self, priority: int) -> bool:
        """Take a slot at once, if :meth:`available` (then :meth:`give_back` it
        later)."""
        if self.available(priority):
            self.in_use += 1
            return True
        return False

    def wait(self, item: T, priority: int, now: float) -> Waiter[T]:
        """Queue ``item`` for a slot (after :meth:`take` said no)."""
        queue = self._urgent if priority <= self.reserved_for else self._rest
        return queue.push(item, priority, now)

    def cancel(self, waiter: Waiter[T]) -> bool:
        """``waiter`` stops waiting; ``False`` if it was handed a slot already (then
        it holds one: give it back)."""
        queue = self._urgent if self.urgent(waiter.priority) else self._rest
        return queue.remove(waiter)

    def give_back(self) -> list[Waiter[T]]:
        """Free a slot; returns the waiters handed the free slots (each counted in
        use now), in order."""
        if self.in_use <= 0:
            raise RuntimeError("a slot was given back that was not taken")
        self.in_use -= 1
        if not self._urgent.count and not self._rest.count:
            return []  # (the common case: nobody waits)
        return self.grant()

    def grant(self) -> list[Waiter[T]]:
        """Hand free slots to the waiters that may take them, best first."""
        granted: list[Waiter[T]] = []
        urgent_queue, rest_queue = self._urgent, self._rest
        while True:
            free = self.total - self.in_use
            if free <= 0:
                return granted
            urgent = urgent_queue.peek() if urgent_queue.count else None
            rest = rest_queue.peek() if rest_queue.count and free > self.reserved else None
            if rest is not None and (urgent is None or rest < urgent):
                best = rest_queue.pop()
            elif urgent is not None:
                best = urgent_queue.pop()
            else:
                return granted
            self.in_use += 1
            granted.append(best)
