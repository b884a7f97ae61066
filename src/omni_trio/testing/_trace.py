"""The record of a simulated run: every command, output, terminal and fault, each
with its virtual time, one line per event.

Two runs with the same seed give the same trace, byte for byte: :meth:`Trace.digest`
is what a test compares.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator
from typing import Any

import trio

from .._util import final

__all__ = ["Trace", "summary"]

#: Data longer than this (said as text) is summarised by its length and CRC.
_SHORT = 48


def summary(data: Any) -> str:
    """``data`` in a line of the trace: itself when short (``'hi:0'``), else its type,
    size and CRC-32 (``bytes[48000]#1a2b3c4d``)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        if len(raw) <= _SHORT:
            return repr(raw)
        return f"bytes[{len(raw)}]#{zlib.crc32(raw):08x}"
    text = repr(data)
    if len(text) <= _SHORT:
        return text
    return f"{type(data).__name__}[{len(text)}]#{zlib.crc32(text.encode()):08x}"


@final
class Trace:
    """Lines of ``<virtual time> <event> <fields>``, in the order they happened.

    Times are seconds since the simulation started, to the microsecond.
    """

    def __init__(self, start: float | None = None) -> None:
        self.start = trio.current_time() if start is None else start
        self.lines: list[str] = []

    def record(self, event: str, *fields: object) -> None:
        """Add a line, stamped with the virtual time now."""
        now = trio.current_time() - self.start
        self.lines.append(" ".join([f"{now:.6f}", event, *map(str, fields)]))

    def digest(self) -> str:
        """SHA-256 of the whole trace (hex): equal digests, equal traces."""
        sha = hashlib.sha256()
        for line in self.lines:
            sha.update(line.encode())
            sha.update(b"\n")
        return sha.hexdigest()

    def __iter__(self) -> Iterator[str]:
        return iter(self.lines)

    def __len__(self) -> int:
        return len(self.lines)

    def __str__(self) -> str:
        return "".join(f"{line}\n" for line in self.lines)

    def __repr__(self) -> str:
        return f"<Trace of {len(self.lines)} events, {self.digest()[:12]}>"
