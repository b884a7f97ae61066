"""omni_trio: a Trio control plane for multi-stage streaming model pipelines."""

from ._dispatch import OrchestratorStatistics
from ._messages import FinishReason, OrchOutput, RequestMetrics, StageItem, StageOutput
from ._orchestrator import Orchestrator, open_orchestrator
from ._stage import Stage
from ._stream import RequestStream

__all__ = [
    "FinishReason",
    "OrchOutput",
    "Orchestrator",
    "OrchestratorStatistics",
    "RequestMetrics",
    "RequestStream",
    "Stage",
    "StageItem",
    "StageOutput",
    "open_orchestrator",
]

__version__ = "0.1.0.dev0"

# Public names report the public module, so reprs and docs say omni_trio.X.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("omni_trio._"):
        _obj.__module__ = __name__
del _name, _obj
