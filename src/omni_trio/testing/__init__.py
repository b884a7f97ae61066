"""Tools for testing code that uses omni_trio (and omni_trio itself).

:class:`ScriptedStage` is a :class:`~omni_trio.Stage` whose outputs a test emits by
hand, in any order, so that any interleaving of outputs and completion reports can be
written down step by step.

:func:`open_simulated_pipeline` runs a whole configured pipeline -- its real workers,
links, heartbeats, restarts and replicas -- in virtual time under a
``trio.testing.MockClock``, every random choice drawn from a seed, with faults from a
:class:`FaultPlan`, and records a :class:`Trace`. :func:`simulate` is one seeded run
of the project's own workload with every invariant checked, :func:`run_seeds` many,
:func:`shrink` a failing one's plan (see ``docs/testing.md``).
"""

from typing import TYPE_CHECKING

from .._util import lazy_exports

if TYPE_CHECKING:  # what __getattr__ provides, spelled out for type checkers
    from ._faults import FAULT_KINDS as FAULT_KINDS
    from ._faults import Fault as Fault
    from ._faults import FaultKind as FaultKind
    from ._faults import FaultPlan as FaultPlan
    from ._scripted import ScriptedStage as ScriptedStage
    from ._scripted import collect_outputs as collect_outputs
    from ._simulation import RequestRecord as RequestRecord
    from ._simulation import SimulatedPipeline as SimulatedPipeline
    from ._simulation import open_simulated_pipeline as open_simulated_pipeline
    from ._trace import Trace as Trace
    from ._workload import BUGS as BUGS
    from ._workload import SimulationResult as SimulationResult
    from ._workload import run_seeds as run_seeds
    from ._workload import shrink as shrink
    from ._workload import simulate as simulate

_EXPORTS = {
    "._scripted": ["ScriptedStage", "collect_outputs"],
    "._faults": ["FAULT_KINDS", "Fault", "FaultKind", "FaultPlan"],
    "._simulation": ["RequestRecord", "SimulatedPipeline", "open_simulated_pipeline"],
    "._trace": ["Trace"],
    "._workload": ["BUGS", "SimulationResult", "run_seeds", "shrink", "simulate"],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
