"""Shared-memory segments for chunks, and the sweeper that frees what is left behind.

Segments are ``multiprocessing.shared_memory`` segments named
``{prefix}-{stage}-{generation}-{request}-{seq}``: the prefix is per pipeline, the
generation per worker of the stage (a restarted worker never reuses a name of its
predecessor's), the request number per request within that worker. They live until
the stage that created them is told to release the request (or its worker dies: then
the sweeper unlinks every segment of that worker). Each segment starts with the id of
the request it belongs to, and :func:`read` checks it, so a chunk can never be read as
another request's. Python's resource tracker is kept out of it -- on 3.10-3.12 it
would otherwise unlink a segment when *any* process that merely attached to it exits
-- so every segment has exactly one owner: us.
"""

from __future__ import annotations

import os
import secrets
import struct
import sys
from collections.abc import Iterable
from multiprocessing import resource_tracker, shared_memory

__all__ = [
    "SHM_DIR",
    "ForeignChunkError",
    "create",
    "listing",
    "new_prefix",
    "read",
    "sweep",
    "unlink",
]

SHM_DIR = "/dev/shm"

_OWNER = struct.Struct(">H")  # the length of the owner's request id, which follows


class ForeignChunkError(Exception):
    """A segment holds another request's chunk."""


def new_prefix() -> str:
    """A name prefix unique to one pipeline: ``ot<pid hex><random hex>``."""
    return f"ot{os.getpid():x}{secrets.token_hex(3)}"


def _untracked(name: str, *, create: bool, size: int = 0) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, create=create, size=size, track=False)
    segment = shared_memory.SharedMemory(name, create=create, size=size)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def create(name: str, owner: str, data: bytes | bytearray | memoryview) -> int:
    """Write ``data`` into a new segment ``name``, marked as request ``owner``'s;
    return the size of ``data`` in bytes."""
    tag = owner.encode()
    start = _OWNER.size + len(tag)
    size = len(data)
    segment = _untracked(name, create=True, size=start + size)
    try:
        buf = segment.buf
        assert buf is not None
        _OWNER.pack_into(buf, 0, len(tag))
        buf[_OWNER.size : start] = tag
        buf[start : start + size] = data
    finally:
        segment.close()
    return size


def read(name: str, owner: str, size: int) -> bytes:
    """Copy the ``size`` bytes of data out of segment ``name``.

    Raises:
      FileNotFoundError: there is no such segment (any more).
      ForeignChunkError: the segment belongs to a request other than ``owner``.
    """
    segment = _untracked(name, create=False)
    try:
        buf = segment.buf
        assert buf is not None
        (length,) = _OWNER.unpack_from(buf, 0)
        start = _OWNER.size + length
        found = bytes(buf[_OWNER.size : start]).decode(errors="replace")
        if found != owner:
            raise ForeignChunkError(f"segment {name} holds a chunk of request {found!r}")
        return bytes(buf[start : start + size])
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
