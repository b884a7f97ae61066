"""A snapshot of a server's per-request records (:class:`ServerStatistics`): what
:meth:`ServerState.statistics <._state.ServerState.statistics>` returns and the
metrics read as gauges. Below both: the state makes the metrics."""

from __future__ import annotations

import attrs

__all__ = ["ServerStatistics"]


@attrs.frozen
class ServerStatistics:
    """A snapshot of the server's per-request records (:meth:`ServerState.statistics`):
    all 0 once no chat request is being handled.

    Attributes:
      active: Chat requests being handled, waiting for a slot or running.
      running: Of those, the ones admitted to the orchestrator.
      waiting: Of those, the ones waiting for a ``max_in_flight`` slot.
      tickets: The requests' places the server keeps (one per active request).
    """

    active: int
    running: int
    waiting: int
    tickets: int
