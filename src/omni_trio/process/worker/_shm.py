"""Shared memory in ``/dev/shm``: names, and the sweeper that frees what is left behind.

Every segment of a pipeline -- the rings its workers create (``_ring``) -- is named
``{prefix}-{stage}-{generation}-...``: the prefix is per pipeline, the generation per
worker of the stage (a restarted worker never reuses a name of its predecessor's).
A segment lives until its worker closes it; when a worker dies, the sweeper unlinks
every segment of that worker, and when the pipeline's block is left, every segment
with its prefix.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable

__all__ = ["SHM_DIR", "listing", "new_prefix", "sweep", "unlink", "worker_name"]

SHM_DIR = "/dev/shm"


def new_prefix() -> str:
    """A name prefix unique to one pipeline: ``ot<pid hex><random hex>``."""
    return f"ot{os.getpid():x}{secrets.token_hex(3)}"


def worker_name(prefix: str, stage_id: int, generation: int) -> str:
    """``{prefix}-{stage}-{generation}``: one worker's name, unique to it (a restarted
    worker never gets its predecessor's). Its segments' names, and the address it
    listens on, start with it."""
    return f"{prefix}-{stage_id}-{generation}"


def unlink(name: str) -> bool:
    """Free segment ``name``; ``False`` if it was already gone."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return False
    return True


def listing(prefix: str) -> list[str]:
    """The segments whose names start with ``prefix``."""
    try:
        names: Iterable[str] = os.listdir(SHM_DIR)
    except FileNotFoundError:  # pragma: no cover - no /dev/shm on this system
        return []
    return sorted(name for name in names if name.startswith(prefix))


def sweep(prefix: str) -> int:
    """Unlink every segment whose name starts with ``prefix``; return how many."""
    return sum(unlink(name) for name in listing(prefix))
