"""A Ray actor's own code: what runs on a node of the cluster for a Ray stage.

Ray pickles :class:`StageActor` by its module path, so every node imports this
module: each must run the same omni_trio version as the orchestrator (see
docs/cluster.md). It imports Ray only inside the actor.
"""

from __future__ import annotations

import os
import socket
import sys

import msgspec
import trio

from ._main import serve_socket
from ._transport import SocketTransport

__all__ = ["Hello", "StageActor"]


class Hello(msgspec.Struct, frozen=True):
    """An actor's first line on its connection back: which launch it answers, and
    where it runs."""

    token: str
    node_id: str
    node_ip: str
    actor_id: str
    pid: int


class StageActor:
    """A Ray actor hosting one stage worker (``ray.remote`` is applied by the
    launcher when a stage is opened: this module imports without Ray)."""

    def serve(self, host: str, port: int, token: str, sys_path: list[str]) -> str:
        """Connect back to the orchestrator at ``host:port`` and serve it there,
        until ``Shutdown`` or until it goes away. Chunk links listen on TCP at this
        node's address: the workers they link may be on other nodes."""
        import ray

        for path in sys_path:  # engines import as they do in the orchestrator's process
            if path and path not in sys.path and os.path.isdir(path):
                sys.path.append(path)
        context = ray.get_runtime_context()
        node_ip = str(ray.util.get_node_ip_address())
        hello = Hello(token, context.get_node_id(), node_ip, context.get_actor_id(), os.getpid())
        control = socket.create_connection((host, port))
        control.sendall(msgspec.json.encode(hello) + b"\n")
        trio.run(serve_socket, control, SocketTransport(node_ip))
        return "its worker returned"
