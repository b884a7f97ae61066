"""One request's own stream of outputs (see :meth:`Orchestrator.open_request`)."""

from __future__ import annotations

import trio

from ._messages import OrchOutput
from ._outbox import Outbox

__all__ = ["RequestStream"]


class RequestStream:
    """The outputs of one request, in order, ending with its terminal output.

    Iterate it with ``async for``; the iteration stops after the terminal output,
    which is also kept in :attr:`terminal`. Get one from
    :meth:`Orchestrator.open_request`. Taking an output is always a cancellation
    point; it yields to the scheduler when none is waiting, and at least once every
    64 outputs otherwise.

    Attributes:
      request_id: The request's id (generated when :meth:`~Orchestrator.open_request`
          was not given one).
      terminal: The request's terminal output once it has been received, else ``None``.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.terminal: OrchOutput | None = None
        self._outbox = Outbox()

    def __repr__(self) -> str:
        state = "open" if self.terminal is None else self.terminal.finish_reason
        return f"<RequestStream {self.request_id!r} {state}>"

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> OrchOutput:
        if self.terminal is not None:
            await trio.lowlevel.checkpoint()
            raise StopAsyncIteration
        output = await self._outbox.get()
        if output.finished:
            self.terminal = output
        return output

    async def receive(self) -> OrchOutput:
        """The request's next output.

        Raises:
          trio.EndOfChannel: the terminal output was already received.
        """
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise trio.EndOfChannel from None
