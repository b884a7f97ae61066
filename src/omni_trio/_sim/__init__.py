"""Deterministic simulation: a whole pipeline in virtual time, replayable from a seed.

Re-exported by :mod:`omni_trio.testing`; see ``docs/testing.md``.
"""

from ._faults import FAULT_KINDS, Fault, FaultKind, FaultPlan
from ._pipeline import RequestRecord, SimulatedPipeline, open_simulated_pipeline
from ._trace import Trace

__all__ = [
    "FAULT_KINDS",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "RequestRecord",
    "SimulatedPipeline",
    "Trace",
    "open_simulated_pipeline",
]
