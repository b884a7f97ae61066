"""omni_trio: a Trio control plane for multi-stage streaming model pipelines."""

from typing import TYPE_CHECKING

from ._util import lazy_exports

if TYPE_CHECKING:  # what __getattr__ provides, spelled out for type checkers
    from ._driver import OrchestratorOptions as OrchestratorOptions
    from ._driver import OrchestratorStatistics as OrchestratorStatistics
    from ._errors import OmniTrioDeprecationWarning as OmniTrioDeprecationWarning
    from ._graph import Route as Route
    from ._graph import StageGraph as StageGraph
    from ._messages import FinishReason as FinishReason
    from ._messages import OrchOutput as OrchOutput
    from ._messages import RequestMetrics as RequestMetrics
    from ._messages import StageItem as StageItem
    from ._messages import StageOutput as StageOutput
    from ._messages import StageRequest as StageRequest
    from ._orchestrator import Orchestrator as Orchestrator
    from ._orchestrator import open_orchestrator as open_orchestrator
    from ._pipeline import Pipeline as Pipeline
    from ._pipeline import PipelineStatistics as PipelineStatistics
    from ._pipeline import open_pipeline as open_pipeline
    from ._slots import PrioritySlots as PrioritySlots
    from ._slots import SlotsStatistics as SlotsStatistics
    from ._stage_protocol import Stage as Stage
    from ._stream import RequestStream as RequestStream

_EXPORTS = {
    "._driver": ["OrchestratorOptions", "OrchestratorStatistics"],
    "._errors": ["OmniTrioDeprecationWarning"],
    "._graph": ["Route", "StageGraph"],
    "._messages": [
        "FinishReason",
        "OrchOutput",
        "RequestMetrics",
        "StageItem",
        "StageOutput",
        "StageRequest",
    ],
    "._orchestrator": ["Orchestrator", "open_orchestrator"],
    "._pipeline": ["Pipeline", "PipelineStatistics", "open_pipeline"],
    "._slots": ["PrioritySlots", "SlotsStatistics"],
    "._stage_protocol": ["Stage"],
    "._stream": ["RequestStream"],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
# Imported on first use, so that a stage worker, which needs none of it, loads none.
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0.dev0"
