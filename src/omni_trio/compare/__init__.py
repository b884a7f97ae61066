"""Trio and asyncio side by side.

:mod:`omni_trio.compare.asyncio_orchestrator` is the asyncio twin of the Trio
orchestrator (the design of the specification this project reimplements, "the
seed", driving the same sans-IO core);
:mod:`omni_trio.compare.asyncio_testing` its test kit; ``omni-trio compare`` runs the
cancellation scenarios of :mod:`omni_trio.compare.scenarios` on both frameworks, and
the barge-in (:mod:`omni_trio.compare.barge_in`) on the plain asyncio design
(:mod:`omni_trio.compare.plain_asyncio`) too.
"""

from typing import TYPE_CHECKING

from .._util import lazy_exports

if TYPE_CHECKING:  # what __getattr__ provides, spelled out for type checkers
    from .asyncio_orchestrator import END_OF_OUTPUTS as END_OF_OUTPUTS
    from .asyncio_orchestrator import AsyncioOrchestrator as AsyncioOrchestrator
    from .asyncio_orchestrator import AsyncioRequestStream as AsyncioRequestStream
    from .asyncio_orchestrator import AsyncioStage as AsyncioStage
    from .asyncio_orchestrator import EndOfOutputs as EndOfOutputs
    from .asyncio_orchestrator import OrchestratorClosed as OrchestratorClosed
    from .asyncio_orchestrator import open_asyncio_orchestrator as open_asyncio_orchestrator

_EXPORTS = {
    ".asyncio_orchestrator": [
        "END_OF_OUTPUTS",
        "AsyncioOrchestrator",
        "AsyncioRequestStream",
        "AsyncioStage",
        "EndOfOutputs",
        "OrchestratorClosed",
        "open_asyncio_orchestrator",
    ],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
