"""Trio and asyncio side by side.

:mod:`omni_trio.compare.asyncio_orchestrator` is the asyncio twin of the Trio
orchestrator (the seed's own design, driving the same sans-IO core);
:mod:`omni_trio.compare.asyncio_testing` its test kit; ``omni-trio compare`` runs the
cancellation scenarios of :mod:`omni_trio.compare.scenarios` on both frameworks.
"""

from .asyncio_orchestrator import (
    END_OF_OUTPUTS,
    AsyncioOrchestrator,
    AsyncioRequestStream,
    AsyncioStage,
    EndOfOutputs,
    OrchestratorClosed,
    open_asyncio_orchestrator,
)

__all__ = [
    "END_OF_OUTPUTS",
    "AsyncioOrchestrator",
    "AsyncioRequestStream",
    "AsyncioStage",
    "EndOfOutputs",
    "OrchestratorClosed",
    "open_asyncio_orchestrator",
]
