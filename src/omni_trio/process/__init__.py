"""Stages in worker processes, and the shared-memory connector between them.

:func:`open_process_stage` runs a stage's engine (see :data:`Engine`) in its own
process and hands back a :class:`~omni_trio.Stage`; :func:`open_inprocess_stage` runs
the same engine in a task of the current process, :func:`open_ray_stage` in a Ray
actor on a node of a cluster; :func:`open_shm_connector` links the workers so that
they stream chunks to each other in async_chunk mode; :func:`open_process_pipeline`
starts the stages of a whole pipeline from a config (:func:`omni_trio.open_pipeline`
adds the orchestrator).

The package has two sides. The worker side, :mod:`omni_trio.process.worker`, is what
a worker runs -- the engine API (:class:`EngineRequest`, :class:`ChunkIO`, ...), the
wire, the links between workers -- and imports nothing from this side. This side
supervises the workers: the stages, their connections, the connector, and one
launcher per backend.
"""

from typing import TYPE_CHECKING

from .._util import lazy_exports

if TYPE_CHECKING:  # what __getattr__ provides, spelled out for type checkers
    from .._process_pipeline import ProcessPipeline as ProcessPipeline
    from .._process_pipeline import open_process_pipeline as open_process_pipeline
    from ._connection import WorkerStartError as WorkerStartError
    from ._connector import ConnectorStatistics as ConnectorStatistics
    from ._connector import ShmConnector as ShmConnector
    from ._connector import open_shm_connector as open_shm_connector
    from ._open import open_inprocess_stage as open_inprocess_stage
    from ._open import open_process_stage as open_process_stage
    from ._options import WorkerOptions as WorkerOptions
    from ._ray_launcher import open_ray_stage as open_ray_stage
    from ._ray_session import RaySession as RaySession
    from ._ray_session import open_ray_session as open_ray_session
    from ._stage import ProcessStage as ProcessStage
    from ._stage import ProcessStageStatistics as ProcessStageStatistics
    from ._stage import ReplicaStatistics as ReplicaStatistics
    from ._stage import WorkerUnavailableError as WorkerUnavailableError
    from .worker._engine import ChunkIO as ChunkIO
    from .worker._engine import ChunkLostError as ChunkLostError
    from .worker._engine import Engine as Engine
    from .worker._engine import EngineFactory as EngineFactory
    from .worker._engine import EngineRequest as EngineRequest
    from .worker._engine import Last as Last
    from .worker._engine import ReaderUnavailableError as ReaderUnavailableError
    from .worker._threads import SimulationError as SimulationError
    from .worker._threads import in_simulation as in_simulation
    from .worker._threads import run_in_thread as run_in_thread
    from .worker._threads import stream_in_thread as stream_in_thread
    from .worker._wire import ProtocolError as ProtocolError

_EXPORTS = {
    "._connection": ["WorkerStartError"],
    "._connector": ["ConnectorStatistics", "ShmConnector", "open_shm_connector"],
    "._options": ["WorkerOptions"],
    # beside omni_trio.open_pipeline, above the configs: nothing in process/ reads one
    ".._process_pipeline": ["ProcessPipeline", "open_process_pipeline"],
    "._ray_launcher": ["open_ray_stage"],
    "._ray_session": ["RaySession", "open_ray_session"],
    "._open": ["open_inprocess_stage", "open_process_stage"],
    "._stage": [
        "ProcessStage",
        "ProcessStageStatistics",
        "ReplicaStatistics",
        "WorkerUnavailableError",
    ],
    ".worker._engine": [
        "ChunkIO",
        "ChunkLostError",
        "Engine",
        "EngineFactory",
        "EngineRequest",
        "Last",
        "ReaderUnavailableError",
    ],
    ".worker._threads": ["SimulationError", "in_simulation", "run_in_thread", "stream_in_thread"],
    ".worker._wire": ["ProtocolError"],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
# Imported on first use: a stage worker imports this package but needs none of it
# but the engine API.
# Where they lived first (documented in docs/cluster.md): found here, with a
# deprecation warning, for one more version.
_MOVED = {name: "omni_trio.process.testing" for name in ("LocalRayCluster", "local_ray_cluster")}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _MOVED)
