"""A client that closes its WebSocket while the server closes it too: Hypercorn's
reader answering the client's Close frame, and the app's task closing the
connection (its app returned), write on one socket at once.

Trio lets one task at a time write on a stream, and counts ``send_eof`` as a write:
``SocketStream.send_eof`` holds the stream's check across a checkpoint, and a
``send_all`` coming from another task in that moment raises ``BusyResourceError``.
Hypercorn's connection (its Trio worker's ``TCPServer``) writes under a lock but
closes (``send_eof``) without it, and lets the error out of the connection, into the
listener's nursery: ``serve`` ended for every client.

The moment is one scheduling step wide (a stress run of thousands of such closes
hit it once), so the tests widen it: :class:`GatedStream` is the server's side of
the connection, a real socket's stream with Trio's rule for writers, whose held
write waits until the close has begun -- as a write that had taken Hypercorn's lock
and not yet reached ``send_all`` does for one step -- and whose ``send_eof`` holds
the writer's place until that write tries. The order is then certain.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request

from omni_trio.serve._server import _Connection
from serve_helpers import PROMPTLY, running_server

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

WS_PATH = "/test/ws"


class GatedStream(trio.abc.HalfCloseableStream):
    """A connection's stream on the server's side: a real socket's, with Trio's rule
    for writers (one at a time, ``send_eof`` counting as one), and the moment a
    write and a close meet made as wide as the test needs.

    Once :attr:`hold` is set, a write waits (:attr:`write_waiting`) until the
    connection's close has begun (``send_eof`` or ``aclose``); a ``send_eof`` that
    finds a write waiting keeps the writer's place until that write tries
    (:attr:`write_tried`). :attr:`fail_reads` makes the next read raise it.
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self.socket = stream.socket  # Hypercorn reads the peer's address from it
        self._writing = False
        self.hold = False
        self.fail_reads: Exception | None = None
        self.write_waiting = trio.Event()
        self.write_tried = trio.Event()
        self.closing = trio.Event()
        self.closed = trio.Event()

    @contextmanager
    def _writer(self) -> Iterator[None]:
        # trio._util.ConflictDetector, as SocketStream's send_all and send_eof use it
        if self._writing:
            raise trio.BusyResourceError("another task is currently sending data on this stream")
        self._writing = True
        try:
            yield
        finally:
            self._writing = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.hold:
            self.write_waiting.set()
            await self.closing.wait()
            self.write_tried.set()
        with self._writer():
            await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        with self._writer():
            await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        with self._writer():
            self.closing.set()
            if self.write_waiting.is_set():
                await self.write_tried.wait()
            await trio.lowlevel.checkpoint()
        await self._stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self.fail_reads is not None:
            raise self.fail_reads
        return await self._stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        self.closing.set()
        try:
            await self._stream.aclose()
        finally:
            self.closed.set()


class Ending:
    """ASGI middleware: ``/test/ws`` is a WebSocket that its app accepts, then leaves
    -- without closing it, so Hypercorn closes it -- once :attr:`end` is set."""

    end: ClassVar[trio.Event]

    def __init__(self, app: Any) -> None:
        self.app = app
        type(self).end = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "websocket" or scope["path"] != WS_PATH:
            await self.app(scope, receive, send)
            return
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        await self.end.wait()


async def open_websocket(client: trio.SocketStream) -> WSConnection:
    """The client's side of ``/test/ws`` on ``client``, accepted."""
    ws = WSConnection(ConnectionType.CLIENT)
    await client.send_all(ws.send(Request(host="127.0.0.1", target=WS_PATH)))
    while True:
        data = await client.receive_some()
        assert data, "the server closed the connection during the handshake"
        ws.receive_data(data)
        if any(isinstance(event, AcceptConnection) for event in ws.events()):
            return ws


async def close_as_the_server_closes(
    ws: WSConnection, client: trio.SocketStream, server_side: GatedStream
) -> None:
    """The client's Close frame comes; the reader's answer takes the connection's
    write lock and waits; the app returns, so its task closes the connection."""
    server_side.hold = True
    await client.send_all(ws.send(CloseConnection(code=1000)))
    with trio.fail_after(PROMPTLY):
        await server_side.write_waiting.wait()
    Ending.end.set()


@pytest.fixture
def accepted(monkeypatch: pytest.MonkeyPatch) -> list[GatedStream]:
    """Every connection the server accepts from now on is a :class:`GatedStream`, in
    this list."""
    streams: list[GatedStream] = []
    accept = trio.SocketListener.accept

    async def gated_accept(self: trio.SocketListener) -> GatedStream:
        streams.append(GatedStream(await accept(self)))
        return streams[-1]

    monkeypatch.setattr(trio.SocketListener, "accept", gated_accept)
    return streams


def serve_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "omni_trio.serve" and r.levelno >= logging.ERROR]


def leaves(error: BaseException | None) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from leaves(inner)
    elif error is not None:
        yield error


async def health(url: str) -> int:
    async with httpx.AsyncClient(timeout=PROMPTLY) as client:
        return (await client.get(url + "/health")).status_code


async def test_a_client_closing_as_the_server_closes_leaves_the_server_serving(
    accepted: list[GatedStream], caplog: pytest.LogCaptureFixture
) -> None:
    """Through ``serve``: the connection ends, with no error, and the server answers
    the next request (before the fix, ``BusyResourceError`` ended ``serve``)."""
    async with running_server(middleware=Ending) as server:
        async with await trio.open_tcp_stream("127.0.0.1", server.port) as client:
            ws = await open_websocket(client)
            (server_side,) = accepted
            await close_as_the_server_closes(ws, client, server_side)
            with trio.fail_after(PROMPTLY):
                await server_side.closed.wait()
                assert await client.receive_some() == b""  # closed, unanswered
        assert server_side.write_tried.is_set()  # the write did come during the close
        assert await health(server.url) == 200
        assert await health(server.url) == 200  # and again, on a new connection
    assert serve_errors(caplog) == []  # serialized: no error, not one caught


async def test_a_connections_unexpected_error_closes_it_alone(
    accepted: list[GatedStream], caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever escapes one connection (here its stream's read fails) is logged on
    ``omni_trio.serve`` and closes that connection; the server goes on."""
    async with running_server(middleware=Ending) as server:
        async with await trio.open_tcp_stream("127.0.0.1", server.port) as client:
            await open_websocket(client)
            (server_side,) = accepted
            server_side.fail_reads = RuntimeError("a bug below the connection")
            await client.send_all(b"\x89\x80" + b"\0" * 4)  # a ping, so the server reads
            with trio.fail_after(PROMPTLY):
                await server_side.closed.wait()
        assert await health(server.url) == 200
    (record,) = serve_errors(caplog)
    assert "failed: closed it (the server goes on)" in record.getMessage()
    assert record.exc_info is not None
    assert [repr(error) for error in leaves(record.exc_info[1])] == [
        "RuntimeError('a bug below the connection')"
    ]


async def connection_closing_as_the_client_closes(connection_class: type[TCPServer]) -> None:
    """One connection of ``connection_class`` over a :class:`GatedStream`, its client
    closing as its app returns, without ``serve``."""
    ours, theirs = trio.socket.socketpair()
    server_side = GatedStream(trio.SocketStream(ours))
    config = Config()
    config.accesslog = None
    app = wrap_app(Ending(None), config.wsgi_max_body_size, None)  # type: ignore[arg-type]
    connection = connection_class(
        app,
        config,
        WorkerContext(None),
        ConnectionState({}),
        server_side,  # type: ignore[arg-type]
    )
    async with trio.SocketStream(theirs) as client, trio.open_nursery() as nursery:
        nursery.start_soon(connection.run)
        ws = await open_websocket(client)
        await close_as_the_server_closes(ws, client, server_side)
        with trio.fail_after(PROMPTLY):
            await server_side.closed.wait()


async def test_hypercorns_own_connection_lets_the_error_out() -> None:
    """The race as it was, without ``serve``: Hypercorn's ``TCPServer`` raises
    ``BusyResourceError`` out of its connection. (If this fails after a Hypercorn
    upgrade, Hypercorn serializes its close itself: ``_Connection._close`` may go.)"""
    with pytest.raises(BaseExceptionGroup) as caught:
        await connection_closing_as_the_client_closes(TCPServer)
    assert [type(error) for error in leaves(caught.value)] == [trio.BusyResourceError]


async def test_our_connection_serializes_the_close(caplog: pytest.LogCaptureFixture) -> None:
    await connection_closing_as_the_client_closes(_Connection)
    assert serve_errors(caplog) == []
