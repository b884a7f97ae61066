"""Stages in worker processes, and the shared-memory connector between them.

:func:`open_process_stage` runs a stage's engine (see :data:`Engine`) in its own
process and hands back a :class:`~omni_trio.Stage`; :func:`open_shm_connector` relays
the chunks stages stream to each other in async_chunk mode.
"""

from ._connector import ShmConnector, open_shm_connector
from ._engine import ChunkIO, Engine, EngineFactory, EngineRequest
from ._pipeline import ProcessPipeline, open_process_pipeline
from ._stage import ProcessStage, WorkerStartError, open_process_stage
from ._wire import MAX_FRAME, ProtocolError

__all__ = [
    "MAX_FRAME",
    "ChunkIO",
    "Engine",
    "EngineFactory",
    "EngineRequest",
    "ProcessPipeline",
    "ProcessStage",
    "ProtocolError",
    "ShmConnector",
    "WorkerStartError",
    "open_process_pipeline",
    "open_process_stage",
    "open_shm_connector",
]
