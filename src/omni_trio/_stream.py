"""One request's own stream of outputs (see :meth:`Orchestrator.open_request`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._outbox import Outbox
from ._sink import StreamBase
from ._util import NoPublicConstructor, final

if TYPE_CHECKING:
    from ._flow import FlowLedger

__all__ = ["RequestStream", "new_stream"]


@final
class RequestStream(StreamBase, metaclass=NoPublicConstructor):
    """The outputs of one request, in order, ending with its terminal output.

    Iterate it with ``async for``; the iteration stops after the terminal output,
    which is also kept in :attr:`terminal`. Get one from
    :meth:`Orchestrator.open_request`. Taking an output is always a cancellation
    point; it yields to the scheduler when none is waiting, and at least once every
    64 outputs otherwise. :meth:`receive_batch` takes every output waiting at once,
    with one cancellation point for the lot.

    Attributes:
      request_id: The request's id (generated when :meth:`~Orchestrator.open_request`
          was not given one).
      terminal: The request's terminal output once it has been received, else ``None``.
          Once the block was left early, the ``"aborted"`` terminal the abort produced,
          with its metrics (or the terminal that was already on its way): the block's
          exit waits for it, up to ``shutdown_grace`` seconds.
    """


def new_stream(request_id: str, flow: FlowLedger | None = None) -> tuple[RequestStream, Outbox]:
    """A stream for ``request_id``, and the outbox the handler fills for it (its reads
    are reported to ``flow``)."""
    outbox = Outbox(flow, request_id)
    return RequestStream._create(request_id, outbox), outbox  # noqa: SLF001 - its own factory
