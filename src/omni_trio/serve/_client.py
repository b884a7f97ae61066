"""A client of our own server, on Trio: ``GET`` with h11, the Realtime WebSocket with
wsproto -- both sans-IO (Hypercorn's own protocol libraries, so the serve extra brings
them), driven over a :func:`trio.open_tcp_stream`. What ``omni-trio talk`` speaks.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.parse
from typing import Any

import attrs
import h11
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

__all__ = ["ClientError", "RealtimeConnection", "Server", "get_json"]

#: What one read takes from the socket.
_READ = 65536


class ClientError(Exception):
    """The server could not be reached, or did not answer as ours does: the message
    says which, in one line."""


@attrs.frozen
class Server:
    """Where a server listens: ``http://host:port`` (``ws://`` too)."""

    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Server:
        """``url``'s host and port (default 8000).

        Raises:
          ClientError: not an ``http://`` or ``ws://`` URL with a host.
        """
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "ws") or not parts.hostname:
            raise ClientError(f"{url!r} is not a server's URL (http://HOST:PORT)")
        try:
            port = parts.port or 8000
        except ValueError:
            raise ClientError(f"{url!r} has no valid port") from None
        return cls(parts.hostname, port)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    async def connect(self) -> trio.SocketStream:
        try:
            return await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise ClientError(f"cannot connect to {self}: {_reason(exc)}") from None


def _reason(exc: OSError) -> str:
    """Why a connection failed, in words: trio says "all attempts failed" and keeps
    each attempt's error in a group (the first one's reason is the one to say)."""
    causes = getattr(exc.__cause__, "exceptions", ())
    first = next((c for c in causes if isinstance(c, OSError)), exc)
    if first.errno:
        return os.strerror(first.errno).lower()
    return (first.strerror or str(first)).lower()


async def get_json(server: Server, target: str) -> Any:
    """``GET target`` from ``server``: its JSON body.

    Raises:
      ClientError: no connection, a status other than 200, or a body that is not
          JSON.
    """
    stream = await server.connect()
    async with stream:
        connection = h11.Connection(h11.CLIENT)
        request = h11.Request(
            method="GET", target=target, headers=[("Host", str(server)), ("Connection", "close")]
        )
        await stream.send_all(connection.send(request) + connection.send(h11.EndOfMessage()))
        status, body = 0, bytearray()
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(_READ))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
    if status != 200:
        raise ClientError(f"GET {target} on {server}: status {status}")
    try:
        return json.loads(body)
    except ValueError:
        raise ClientError(f"GET {target} on {server}: not JSON") from None


class RealtimeConnection:
    """One WebSocket to ``/v1/realtime``: JSON events each way.

    Use :meth:`open`; close it with :meth:`aclose` (``async with`` does).
    """

    def __init__(self, stream: trio.SocketStream, ws: WSConnection) -> None:
        self._stream = stream
        self._ws = ws
        self._events: list[Any] = []
        self.closed: str | None = None  # why the server closed it, once it did

    @classmethod
    async def open(cls, server: Server, target: str) -> RealtimeConnection:
        """Connect and shake hands.

        Raises:
          ClientError: no connection, or the server refused the upgrade (its status,
              and the reason it gave, if any).
        """
        stream = await server.connect()
        ws = WSConnection(ConnectionType.CLIENT)
        try:
            await _handshake(server, stream, ws, target)
        except BaseException:
            await stream.aclose()
            raise
        return cls(stream, ws)

    async def __aenter__(self) -> RealtimeConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def send(self, event: dict[str, Any]) -> None:
        await self._stream.send_all(self._ws.send(TextMessage(data=json.dumps(event))))

    async def receive(self) -> dict[str, Any] | None:
        """The next server event; ``None`` once the server closed the socket
        (:attr:`closed` says why)."""
        text: list[str] = []
        while True:
            for event in self._ws.events():
                if isinstance(event, TextMessage):
                    text.append(event.data)
                    if event.message_finished:
                        return json.loads("".join(text))  # type: ignore[no-any-return]
                elif isinstance(event, Ping):
                    await self._stream.send_all(self._ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    self.closed = f"{event.code} {event.reason or ''}".strip()
                    return None
                elif isinstance(event, BytesMessage):
                    continue  # the API sends none
            try:
                data = await self._stream.receive_some(_READ)
            except (trio.BrokenResourceError, OSError) as exc:
                data, self.closed = b"", f"the connection broke ({exc})"
            if not data:
                self.closed = self.closed or "the connection closed"
                return None
            self._ws.receive_data(data)

    async def aclose(self) -> None:
        # Say goodbye, bounded; a socket already closed, or closing, hears nothing.
        with trio.move_on_after(1, shield=True), contextlib.suppress(Exception):
            await self._stream.send_all(self._ws.send(CloseConnection(code=1000)))
        await self._stream.aclose()


async def _handshake(
    server: Server, stream: trio.SocketStream, ws: WSConnection, target: str
) -> None:
    """Ask for the upgrade; return once it is accepted."""
    await stream.send_all(ws.send(Request(host=str(server), target=target)))
    while True:
        data = await stream.receive_some(_READ)
        if not data:
            raise ClientError(f"{server} closed the connection during the handshake")
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                return
            if isinstance(event, RejectConnection):
                body = await _rejection_body(ws, stream, event)
                raise ClientError(f"{server} refused the session: {body}")


async def _rejection_body(ws: WSConnection, stream: trio.SocketStream, event: Any) -> str:
    """What a refused upgrade says: its status, and its body's error message."""
    body = bytearray()
    if event.has_body:
        with trio.move_on_after(1):
            while True:
                for part in ws.events():
                    body += getattr(part, "data", b"")
                    if getattr(part, "body_finished", False):
                        break
                else:
                    data = await stream.receive_some(_READ)
                    if not data:
                        break
                    ws.receive_data(data)
                    continue
                break
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = bytes(body).decode("utf-8", "replace").strip()
    return f"status {event.status_code}" + (f": {message}" if message else "")
