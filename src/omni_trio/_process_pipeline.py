"""A whole pipeline of stages -- each in a worker process, in-process or in a Ray
actor -- from a config (:func:`omni_trio.process.open_process_pipeline`).

It reads a config and opens the process wing's stages, so it sits above both, beside
:func:`omni_trio.open_pipeline`: nothing in ``process/`` reads a config."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import attrs

from ._util import final, stage_label
from .config import OutputType, PipelineConfig
from .process._connector import ShmConnector, open_shm_connector
from .process._open import open_inprocess_stage, open_process_stage
from .process._stage import ProcessStage
from .process.worker import _shm

__all__ = ["ProcessPipeline", "open_process_pipeline", "open_stages"]


@final
@attrs.frozen
class ProcessPipeline:
    """Running stages, ready for :func:`omni_trio.open_orchestrator` (which is what
    :func:`omni_trio.open_pipeline` does with them; this is the step below it, for an
    orchestrator of your own)::

        async with open_process_pipeline(config) as pipeline:
            async with open_orchestrator(
                *pipeline.orchestrator_args, **pipeline.orchestrator_kwargs
            ) as orch:
                ...

    Attributes:
      config: What it was started from.
      stages: One :class:`ProcessStage` per configured stage (in a worker process,
          or in-process, as its ``runtime.backend`` says).
      prefix: The shared-memory name prefix of every segment of this pipeline.
      connector: The shm connector that links the workers (async_chunk mode), or ``None``.
    """

    config: PipelineConfig
    stages: list[ProcessStage]
    prefix: str
    connector: ShmConnector | None

    @property
    def orchestrator_args(self) -> tuple[list[ProcessStage], dict[int, OutputType]]:
        """The stages, and the final ones with what each emits (so every output says
        its ``output_type``)."""
        return self.stages, self.config.final_output_types

    @property
    def orchestrator_kwargs(self) -> dict[str, Any]:
        """``graph=``, ``prewarm_fn=`` or ``input_fn=``, and the ``[pipeline]``
        options (``stage_idle_timeout=``, ``max_in_flight=``, ...), from the config."""
        return {**self.config.orchestrator_functions(), **self.config.orchestrator_options}


@asynccontextmanager
async def open_process_pipeline(config: PipelineConfig) -> AsyncIterator[ProcessPipeline]:
    """Start a worker per stage of ``config`` (and the connector that links them): a worker
    process (:func:`open_process_stage`), or, as a stage's ``[stages.runtime]
    backend`` says, a task of this process (``"inprocess"``,
    :func:`open_inprocess_stage`) or a Ray actor (``"ray"``, :func:`open_ray_stage`,
    on the cluster at ``[pipeline] ray_address``, or a local one). With Ray stages,
    every worker that reads chunks listens on TCP: its upstream may be on another host.

    Leaving the block stops the workers and sweeps every shared-memory segment the
    pipeline's prefix names, whatever a dead worker left behind.
    """
    async with open_stages(config) as pipeline:
        yield pipeline


#: Opens one configured stage: ``opener(engine, stage_id=, name=, engine_args=,
#: prefix=, connector=, options=)``, a stage for the block.
StageOpener = Callable[..., AbstractAsyncContextManager[ProcessStage]]


@asynccontextmanager
async def open_stages(
    config: PipelineConfig,
    *,
    prefix: str | None = None,
    opener: StageOpener | None = None,
    segments: _shm.Segments = _shm.SHM,
) -> AsyncIterator[ProcessPipeline]:
    """:func:`open_process_pipeline`, with what a simulation replaces: the name
    prefix, one opener for every stage (instead of its backend's), and where the
    rings live."""
    prefix = _shm.new_prefix() if prefix is None else prefix
    config.orchestrator_functions()  # fail early on a bad function import path
    try:
        async with AsyncExitStack() as stack:
            openers: dict[str, Any] = {
                "process": open_process_stage,
                "inprocess": open_inprocess_stage,
            }
            listen_host = ""
            if opener is None and any(stage.runtime.backend == "ray" for stage in config.stages):
                from .process._ray_launcher import open_ray_stage
                from .process._ray_session import open_ray_session

                address = config.pipeline.ray_address
                session = await stack.enter_async_context(open_ray_session(address))
                listen_host = session.host
                openers["ray"] = partial(open_ray_stage, ray_address=address)
            connector = None
            if config.pipeline.async_chunk and config.pipeline.connector == "shm":
                graph = config.graph
                routes = {sid: list(out) for sid, out in enumerate(graph.outputs) if out}
                connector = await stack.enter_async_context(
                    open_shm_connector(
                        routes,
                        prefix=prefix,
                        inline_chunk_bytes=config.pipeline.inline_chunk_bytes,
                        ring_bytes=config.pipeline.ring_bytes,
                        listen_host=listen_host,
                        window=config.pipeline.window,
                        window_bytes=config.pipeline.window_bytes,
                        segments=segments,
                    )
                )
                # Every stage, before the first starts: a worker learns the stages it
                # sends to (how long to wait for theirs) when it starts.
                for stage in config.stages:
                    label = stage_label(stage.stage_id, stage.label)
                    connector.add_stage(stage.stage_id, label, stage.runtime.startup_timeout)
            stages = []
            for stage in config.stages:
                process_stage = await stack.enter_async_context(
                    (opener or openers[stage.runtime.backend])(
                        stage.engine,
                        stage_id=stage.stage_id,
                        name=stage.label,
                        engine_args=stage.engine_args,
                        prefix=prefix,
                        connector=connector,
                        options=stage.runtime,
                    )
                )
                stages.append(process_stage)
            yield ProcessPipeline(config, stages, prefix, connector)
    finally:
        _shm.sweep(prefix, segments)
