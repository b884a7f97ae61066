from __future__ import annotations

import os
import re
from multiprocessing import resource_tracker

import pytest
from hypothesis import HealthCheck, settings

from helpers import FULL_SIZE
from omni_trio.process.worker import _shm

# "ci" runs more examples; "dev" (the default) keeps the suite quick on a laptop, and
# is what CI runs on the Pythons that run the suite at the small size (helpers.FULL_SIZE).
settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
_CI_PROFILE = "ci" if os.environ.get("CI") and FULL_SIZE else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _CI_PROFILE))

#: The shared-memory names this test process's pipelines make (``_shm.new_prefix``:
#: ``ot<our pid in hex><6 hex digits>``, then ``-...``); other processes' runs, on a
#: shared machine, make others.
_OURS = re.compile(rf"ot{os.getpid():x}[0-9a-f]{{6}}(-|$)")


def _our_segments() -> set[str]:
    return {name for name in _shm.listing("ot") if _OURS.match(name)}


def _tracker_started() -> bool:
    return resource_tracker._resource_tracker._fd is not None  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _no_shared_memory_left_behind():
    """Every test: no shared-memory segment of ours that appeared during it is left
    after it (whatever made it: a ring, a test's own), and no resource tracker was
    started in this process (one that tracks a segment warns about it, or unlinks it,
    when it exits). What is left is swept, so one leak fails one test. (Worker
    processes: ``processes.running`` checks that none started a tracker.)"""
    before = _our_segments()
    tracker_before = _tracker_started()
    yield
    left = sorted(_our_segments() - before)
    for name in left:
        _shm.unlink(name)
    assert left == [], f"shared memory left behind: {left}"
    assert tracker_before or not _tracker_started(), "a resource tracker was started"


@pytest.fixture(scope="session", autouse=os.environ.get("OMNI_TRIO_STAGE_BACKEND") == "ray")
def _ray_cluster_for_every_stage():
    """``OMNI_TRIO_STAGE_BACKEND=ray``: the tests' pipelines run on Ray actors, on a
    local two-node cluster up for the session."""
    from omni_trio.process.testing import local_ray_cluster

    with local_ray_cluster({"node_a": 8}, {"node_b": 8}):
        yield


def pytest_collection_modifyitems(config, items):
    """``OMNI_TRIO_STAGE_BACKEND=ray``: skip what only worker processes do, and what
    no backend changes (shown once, on worker processes)."""
    if os.environ.get("OMNI_TRIO_STAGE_BACKEND") is None:
        return
    for item in items:
        marker = item.get_closest_marker("process_specific")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"process-specific: {marker.args[0]}"))
        marker = item.get_closest_marker("backend_agnostic")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"backend-agnostic: {marker.args[0]}"))
