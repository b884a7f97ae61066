"""Shared-memory segments for chunks, and the sweeper that frees what is left behind.

Segments are ``multiprocessing.shared_memory`` segments named
``{prefix}-{stage}-{request}-{seq}``; the prefix is per pipeline. They live until the
stage that created them is told to release the request (or its worker dies: then the
sweeper unlinks every segment with that stage's prefix). Python's resource tracker is
kept out of it -- on 3.10-3.12 it would otherwise unlink a segment when *any* process
that merely attached to it exits -- so every segment has exactly one owner: us.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterable
from multiprocessing import resource_tracker, shared_memory

__all__ = ["SHM_DIR", "create", "listing", "new_prefix", "read", "sweep", "unlink"]

SHM_DIR = "/dev/shm"


def new_prefix() -> str:
    """A name prefix unique to one pipeline: ``ot<pid hex><random hex>``."""
    return f"ot{os.getpid():x}{secrets.token_hex(3)}"


def _untracked(name: str, *, create: bool, size: int = 0) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, create=create, size=size, track=False)
    segment = shared_memory.SharedMemory(name, create=create, size=size)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def create(name: str, data: bytes | bytearray | memoryview) -> int:
    """Write ``data`` into a new segment ``name``; return its size in bytes."""
    size = len(data)
    segment = _untracked(name, create=True, size=max(size, 1))
    try:
        assert segment.buf is not None
        segment.buf[:size] = data
    finally:
        segment.close()
    return size


def read(name: str, size: int) -> bytes:
    """Copy the first ``size`` bytes out of segment ``name``."""
    segment = _untracked(name, create=False)
    try:
        assert segment.buf is not None
        return bytes(segment.buf[:size])
    finally:
        segment.close()


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
