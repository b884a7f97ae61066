"""The worker side of the process boundary: what a stage worker runs, wherever it runs
-- a process of its own, a task of the orchestrator's Trio run, a Ray actor.

``python -m omni_trio.process.worker --control-fd N`` (:func:`main`) is a worker
process, as a process stage spawns it. The package's modules import each other and
omni_trio's foundations (``_util``), never the supervisor's side (the rest of
:mod:`omni_trio.process`) nor the orchestrator's, so a worker process loads them and
nothing else of ours:

- ``_engine``: the engine API (:mod:`omni_trio.process` re-exports it);
- ``_wire``: the messages and their framing, sans-IO; ``_framing``: frames on Trio
  streams; ``_transport``: where the streams of chunk links come from;
- ``_worker``: the serve loop; ``_requests``: what it keeps per request;
- ``_links``, ``_ring``, ``_shm``: the data plane between workers;
- ``_main``: a worker process's entry point; ``_ray_actor``: a Ray actor's.
"""

from typing import TYPE_CHECKING

from ..._util import lazy_exports

if TYPE_CHECKING:  # what __getattr__ provides, spelled out for type checkers
    from ._main import main as main

_EXPORTS = {"._main": ["main"]}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
# Imported on first use: the supervisor imports modules of this package, and needs
# no worker's entry point.
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
