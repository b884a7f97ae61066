"""Preemption for one model: while an urgent request generates, the others pause at
their next token, and resume from their text so far once none does (or once they
have paused for long enough).

llama.cpp steps every running slot together, on the same threads, so an urgent
request that found a slot free still shares each step with the generations running
beside it. Pausing those gives it the model alone. A paused generation keeps its slot
(no one else takes it meanwhile), gives llama.cpp's back (its task ends at the next
token; its cache stays, and the resumed prompt reuses it), and resumes as an
assistant prefill: its messages, then its answer so far for the model to continue.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio
from trio_util import AsyncValue

__all__ = ["Preemption", "continued"]


class Preemption:
    """Urgent generations running on one model, and how long another may pause.

    Args:
      max_pause_s: The most a generation pauses in all, so that a steady stream of
          urgent requests cannot starve it: past it, it runs on beside them.
    """

    def __init__(self, max_pause_s: float) -> None:
        self.max_pause_s = max_pause_s
        self._urgent = AsyncValue(0)

    @property
    def urgent_running(self) -> int:
        return int(self._urgent.value)

    @contextmanager
    def urgent(self) -> Iterator[None]:
        """An urgent request generates for the block: the others pause."""
        self._urgent.value += 1
        try:
            yield
        finally:
            self._urgent.value -= 1

    def pauses(self, paused_s: float) -> bool:
        """Whether a generation that has paused ``paused_s`` seconds so far pauses now."""
        return self._urgent.value > 0 and paused_s < self.max_pause_s

    async def pause(self, paused_s: float) -> float:
        """Wait until no urgent request generates, for at most what is left of
        ``max_pause_s``; returns the seconds waited."""
        began = trio.current_time()
        with trio.move_on_after(self.max_pause_s - paused_s):
            await self._urgent.wait_value(0)
        return trio.current_time() - began


def continued(body: dict[str, Any], said: str, max_tokens: int | None) -> dict[str, Any]:
    """``body`` to resume from ``said``: its messages with ``said`` as the assistant's
    turn so far (llama.cpp continues a last assistant message), and what is left of
    its ``max_tokens``."""
    resumed = {**body, "messages": [*body["messages"], {"role": "assistant", "content": said}]}
    if max_tokens is not None:
        resumed["max_tokens"] = max_tokens
    return resumed
