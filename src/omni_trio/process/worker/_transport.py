"""How a worker reaches its peers: the one seam between the worker and the network.

A worker talks to the orchestrator over one ``trio.abc.Stream`` (its control
connection, handed to :func:`~._worker.serve`) and to the workers next to it over
chunk links, which it opens through a :class:`Transport`: it *listens* for the links
of the workers upstream of it, and *connects* to the workers downstream. Everything
above this seam -- the serve loop, the links, the framing -- sees only Trio's stream
and listener interfaces, so any transport that provides them serves: sockets here
(:class:`SocketTransport`), or in-memory streams
(:class:`omni_trio.process.testing.MemoryNetwork`), with which a whole pipeline's
workers run in one process without a socket.

Addresses are strings, carried by ``wire.Ready`` (where a worker listens) and
``wire.Route`` (where to send): ``"\\0name"`` is a Linux abstract Unix socket (no
file to clean up) and ``"tcp:host:port"`` a TCP one; a transport of its own may use
any other form.
"""

from __future__ import annotations

import socket
from typing import Protocol

import trio

from ..._util import final
from ._shm import SHM, Segments, worker_name

__all__ = ["LINK_SEND_BUFFER", "SocketTransport", "Transport", "listen_address", "tcp_address"]

#: The kernel's send buffer of a chunk link, in bytes.
LINK_SEND_BUFFER = 1 << 20

#: Upstream workers that may be waiting to connect to a listening worker at once.
_BACKLOG = 64


class Transport(Protocol):
    """Where a worker's chunk links come from, and the segments its rings live in
    (those a link that may carry ring offsets shares with its reader)."""

    segments: Segments

    async def listen(self, name: str) -> tuple[trio.abc.Listener[trio.abc.Stream], str]:
        """Listen for the links of upstream workers.

        ``name`` is unique to this worker (``{prefix}-{stage}-{generation}``: a
        restarted worker never gets its predecessor's). Returns the listener and its
        address, which the worker reports in ``wire.Ready``.
        """

    async def connect(self, address: str) -> tuple[trio.abc.Stream, bool]:
        """Open a link to the worker listening at ``address``; also whether the link
        may carry ring offsets (the reader maps our shared memory: it shares our
        host). Raises ``OSError`` if nobody listens there (any more)."""


def listen_address(prefix: str, stage_id: int, generation: int) -> str:
    """Where stage ``stage_id``'s worker ``generation`` listens for chunk links on its
    own host: a Linux abstract socket name (no file to clean up), unique to the worker.
    (A worker that may be read from another host listens on TCP instead; its address
    is ``tcp_address(host, port)``.)"""
    return _unix_address(worker_name(prefix, stage_id, generation))


def _unix_address(name: str) -> str:
    return f"\0{name}"


def tcp_address(host: str, port: int) -> str:
    """A chunk link's TCP address, as ``Ready`` and ``Route`` carry it."""
    return f"tcp:{host}:{port}"


@final
class SocketTransport:
    """Chunk links over sockets: a worker listens on an abstract Unix socket of its
    host, or -- with ``host`` -- on TCP at that address, so that workers of other hosts
    can connect (a Ray actor listens on its node's address). It connects to either."""

    segments: Segments = SHM

    def __init__(self, host: str = "") -> None:
        self.host = host

    def __repr__(self) -> str:
        return f"SocketTransport({self.host!r})"

    async def listen(self, name: str) -> tuple[trio.abc.Listener[trio.abc.Stream], str]:
        if self.host:  # TCP: upstream workers may be on other hosts
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            await sock.bind((self.host, 0))
            address = tcp_address(self.host, sock.getsockname()[1])
        else:
            address = _unix_address(name)
            sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            await sock.bind(address)
        sock.listen(_BACKLOG)
        return trio.SocketListener(sock), address

    async def connect(self, address: str) -> tuple[trio.abc.Stream, bool]:
        """Over TCP the reader may be on another host: every chunk travels inside its
        frame. Over a Unix socket it shares ours, and so our shared memory."""
        stream: trio.SocketStream
        if address.startswith("tcp:"):
            host, _, port = address[4:].rpartition(":")
            stream, shared_memory = await trio.open_tcp_stream(host, int(port)), False
        else:
            stream, shared_memory = await trio.open_unix_socket(address), True
        try:  # room for a burst of big chunks in the kernel, not a wake-up per chunk
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LINK_SEND_BUFFER)
        except OSError:
            await trio.aclose_forcefully(stream)
            raise
        return stream, shared_memory
