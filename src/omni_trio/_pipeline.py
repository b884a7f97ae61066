"""A configured pipeline in one block: its stages' workers and the orchestrator over
them (:func:`open_pipeline`)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs

from ._driver import OrchestratorStatistics
from ._orchestrator import Orchestrator, open_orchestrator
from ._process_pipeline import ProcessPipeline, open_process_pipeline
from ._util import NoPublicConstructor, final
from .config import PipelineConfig, resolve_pipeline
from .process._connector import ConnectorStatistics, ShmConnector
from .process._stage import ProcessStage, ProcessStageStatistics

__all__ = ["Pipeline", "PipelineStatistics", "open_pipeline"]


@final
@attrs.frozen
class PipelineStatistics:
    """A snapshot of a running :class:`Pipeline`, from :meth:`Pipeline.statistics`.

    Attributes:
      orchestrator: The orchestrator's (:meth:`Orchestrator.statistics`).
      stages: Each stage's, in stage order (:meth:`ProcessStage.statistics`).
      connector: The connector's, in async_chunk mode; ``None`` in forward mode.
    """

    orchestrator: OrchestratorStatistics
    stages: tuple[ProcessStageStatistics, ...]
    connector: ConnectorStatistics | None


@final
class Pipeline(metaclass=NoPublicConstructor):
    """A running pipeline, from :func:`open_pipeline`.

    Attributes:
      config: The config it runs (with the overrides applied).
      orchestrator: The :class:`Orchestrator` over its stages: admit requests here.
      stages: Its :class:`~omni_trio.process.ProcessStage`\\ s, in stage order.
      connector: The :class:`~omni_trio.process.ShmConnector` that links its workers
          in async_chunk mode; ``None`` in forward mode.
      prefix: The shared-memory name prefix of every segment of the pipeline.
    """

    def __init__(
        self, config: PipelineConfig, orchestrator: Orchestrator, processes: ProcessPipeline
    ) -> None:
        self.config = config
        self.orchestrator = orchestrator
        self.stages: tuple[ProcessStage, ...] = tuple(processes.stages)
        self.connector: ShmConnector | None = processes.connector
        self.prefix = processes.prefix

    def __repr__(self) -> str:
        names = " -> ".join(self.config.stage_names.values())
        return f"<Pipeline {self.config.pipeline.name!r} ({names}, {self.config.mode})>"

    def statistics(self) -> PipelineStatistics:
        """Return a snapshot of the orchestrator, every stage and the connector."""
        connector = self.connector
        return PipelineStatistics(
            orchestrator=self.orchestrator.statistics(),
            stages=tuple(stage.statistics() for stage in self.stages),
            connector=None if connector is None else connector.statistics(),
        )


@asynccontextmanager
async def open_pipeline(
    config: PipelineConfig | str | os.PathLike[str], /, **pipeline_overrides: Any
) -> AsyncIterator[Pipeline]:
    """Run a configured pipeline for the duration of the block: a worker per stage
    (:func:`~omni_trio.process.open_process_pipeline`) and an orchestrator over them
    with the config's functions and options (:func:`open_orchestrator`).

    ::

        async with open_pipeline("demo", max_in_flight=4) as pipeline:
            async with pipeline.orchestrator.open_request("Hello") as stream:
                async for out in stream:
                    ...

    Leaving the block shuts the orchestrator down (every request in flight gets its
    ``"aborted"`` terminal), then stops the workers and frees their shared memory.

    Args:
      config: A :class:`~omni_trio.config.PipelineConfig`; a path to a TOML config
          (a string naming an existing file is one); or the name of a pipeline
          shipped with the package, ``"demo"`` or ``"speech"``.
      pipeline_overrides: ``[pipeline]`` keys to replace, checked as a loaded
          config's are (:meth:`~omni_trio.config.PipelineConfig.with_pipeline`):
          ``max_in_flight=4``, ``stage_idle_timeout=30.0``, ...

    Raises:
      ConfigError: the config cannot be read, is invalid, names a function that
          cannot be imported, or an override is (the message names the key).
      WorkerStartError: a stage's worker could not be started.
    """
    resolved = resolve_pipeline(config)
    if pipeline_overrides:
        resolved = resolved.with_pipeline(**pipeline_overrides)
    async with (
        open_process_pipeline(resolved) as processes,
        open_orchestrator(
            processes.stages,
            resolved.final_output_types,  # {stage_id: final_output_type}
            options=resolved.options(),
        ) as orchestrator,
    ):
        yield Pipeline._create(resolved, orchestrator, processes)  # noqa: SLF001 - its own factory
