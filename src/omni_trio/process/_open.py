"""Opening a stage: one opener per backend (:func:`open_process_stage`,
:func:`open_inprocess_stage`; ``open_ray_stage`` lives with its launcher), all
through :func:`open_stage`, which checks the options, names the stage and runs its
supervisor (:class:`~omni_trio.process.ProcessStage`) for the block."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs

from .._util import import_object
from ._connector import ShmConnector
from ._launcher import WorkerLauncher
from ._options import WorkerOptions
from ._process_launcher import ProcessLauncher
from ._stage import ProcessStage
from ._task_launcher import TaskLauncher
from .worker import _shm
from .worker._engine import EngineFactory

__all__ = [
    "importable_path",
    "open_inprocess_stage",
    "open_process_stage",
    "open_stage",
    "stage_options",
]


def _factory_path(engine: str | EngineFactory) -> str:
    """An engine given as a factory object, said as its import path."""
    if isinstance(engine, str):
        return engine
    if not callable(engine):
        raise TypeError(f"engine must be an import path or a factory, got {engine!r}")
    module = getattr(engine, "__module__", None)
    qualname = getattr(engine, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(engine)


def importable_path(engine: str | EngineFactory) -> str:
    """A worker process imports its engine's factory: a factory object must be found
    at its import path."""
    path = _factory_path(engine)
    if isinstance(engine, str):
        return path
    try:
        found = import_object(path)
    except Exception:
        found = None
    if found is not engine:
        raise TypeError(
            f"a worker process imports its engine's factory, and {engine!r} cannot be "
            f"imported as {path!r}: define it at a module's top level, or run it with "
            "open_inprocess_stage"
        )
    return path


@asynccontextmanager
async def open_process_stage(
    engine: str | EngineFactory,
    *,
    stage_id: int = 0,
    name: str | None = None,
    engine_args: Mapping[str, Any] | None = None,
    prefix: str | None = None,
    connector: ShmConnector | None = None,
    options: WorkerOptions | None = None,
) -> AsyncIterator[ProcessStage]:
    """Start a worker process running ``engine`` and use it as a stage in the block.

    Leaving the block stops the worker (``Shutdown``, then a kill after
    ``options.shutdown_grace`` seconds), whatever it is doing: serving, starting, or
    restarting.

    Args:
      engine: Import path of the engine factory, ``"package.module:name"``; called in
          the worker with ``engine_args`` as keyword arguments (see
          :data:`~omni_trio.process.Engine`). A factory object is accepted if it can
          be imported back from its module and name.
      stage_id: The stage's index in the pipeline (names its segments and messages).
      name: For messages (default: ``stage<stage_id>``).
      engine_args: The factory's keyword arguments (they travel as msgpack).
      prefix: The pipeline's shared-memory name prefix (default: the connector's, or
          a fresh one).
      connector: The pipeline's :class:`ShmConnector`, for async_chunk mode.
      options: How the worker is run: restarts, heartbeats, timeouts (see
          :class:`WorkerOptions`; default: ``WorkerOptions()``). Its ``backend`` is
          set to ``"process"``.

    Raises:
      WorkerStartError: the worker could not be started; the message says why (an
          import error in the factory, a crash, a timeout).
    """
    async with open_stage(
        importable_path(engine),
        ProcessLauncher(),
        stage_id=stage_id,
        name=name,
        engine_args=engine_args,
        prefix=prefix,
        connector=connector,
        options=options,
    ) as stage:
        yield stage


@asynccontextmanager
async def open_inprocess_stage(
    engine: str | EngineFactory,
    *,
    stage_id: int = 0,
    name: str | None = None,
    engine_args: Mapping[str, Any] | None = None,
    prefix: str | None = None,
    connector: ShmConnector | None = None,
    options: WorkerOptions | None = None,
) -> AsyncIterator[ProcessStage]:
    """Run ``engine`` in a task of this Trio run and use it as a stage in the block.

    The same engine, the same arguments and the same stage as
    :func:`open_process_stage`, without the process: the worker's own code serves the
    stage in a task, over socket pairs instead of a process's inherited connections,
    so everything behaves as it does in a process -- inputs, outputs and
    ``engine_args`` travel as msgpack, chunks through shared memory and the
    connector, aborts, releases and restarts alike. An in-process stage and process
    stages mix in one pipeline.

    Leaving the block stops the worker (``Shutdown``; after
    ``options.shutdown_grace`` seconds its task is cancelled) and no task of it
    outlives the block.

    What differs: the engine shares this process's event loop, so an engine (or a
    factory loading a model) that blocks it blocks the orchestrator too; there are
    no heartbeat deaths, since a stuck task stops everything (it is pinged for
    its statistics all the same); ``kill`` cancels the task;
    ``pid`` is ``None``.

    Args:
      engine: The engine factory, or its import path ``"package.module:name"``;
          called with ``engine_args`` as keyword arguments. To hand the engine live
          objects (a loaded model), bind them into the factory, e.g. with
          :func:`functools.partial`.
      stage_id, name, engine_args, prefix, connector: As for
          :func:`open_process_stage`.
      options: As for :func:`open_process_stage`; its ``backend`` is set to
          ``"inprocess"``.

    Raises:
      WorkerStartError: the engine could not be loaded; the message says why.
    """
    factory = None if isinstance(engine, str) else engine
    async with open_stage(
        _factory_path(engine),
        TaskLauncher(factory),
        stage_id=stage_id,
        name=name,
        engine_args=engine_args,
        prefix=prefix,
        connector=connector,
        options=options,
    ) as stage:
        yield stage


def stage_options(options: WorkerOptions | None, backend: str) -> WorkerOptions:
    """An opener's ``options``, checked, with its own ``backend``.

    Raises:
      TypeError: not a :class:`WorkerOptions`.
      ValueError: a field that ``backend`` refuses (a Ray placement elsewhere).
    """
    if options is None:
        return WorkerOptions(backend=backend)
    if not isinstance(options, WorkerOptions):
        raise TypeError(f"options must be a WorkerOptions, got {options!r}")
    return options if options.backend == backend else attrs.evolve(options, backend=backend)


@asynccontextmanager
async def open_stage(
    engine: str,
    launcher: WorkerLauncher | Sequence[WorkerLauncher],
    *,
    stage_id: int,
    name: str | None,
    engine_args: Mapping[str, Any] | None,
    prefix: str | None,
    connector: ShmConnector | None,
    options: WorkerOptions | None,
) -> AsyncIterator[ProcessStage]:
    if isinstance(launcher, Sequence):  # one per replica (a simulation's)
        launchers = list(launcher)
        options = stage_options(options, launchers[0].backend)
        if len(launchers) != options.replicas:
            raise ValueError(f"{len(launchers)} launchers for {options.replicas} replicas")
    else:
        options = stage_options(options, launcher.backend)
        launchers = [launcher] * options.replicas
    if options.devices:  # only a process's (see WorkerOptions): one per replica
        launchers = [
            ProcessLauncher({"CUDA_VISIBLE_DEVICES": device}) for device in options.devices
        ]
    if prefix is None:
        prefix = connector.prefix if connector is not None else _shm.new_prefix()
    stage = ProcessStage._create(  # noqa: SLF001 - the module's own factory
        engine,
        stage_id=stage_id,
        name=name or f"stage{stage_id}",
        engine_args=engine_args or {},
        prefix=prefix,
        connector=connector,
        options=options,
        launchers=launchers,
    )
    async with stage._running():  # noqa: SLF001 - the module's own factory
        yield stage
