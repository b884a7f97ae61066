"""A request's body, read up to ``max_request_bytes``, and the 413 that refuses more.

The body is read message by message from ASGI ``receive``: a ``Content-Length`` over
the bound is refused before any of it is read, and a body of no declared length
(``Transfer-Encoding: chunked``) is refused as soon as the count passes the bound.
Either way the rest is never read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ._protocol import OpenAIError, encode

if TYPE_CHECKING:
    from ._chat import Receive, Scope, Send

__all__ = [
    "read_body",
    "refuse",
    "too_large",
]


def too_large(limit: int, length: int | None = None) -> OpenAIError:
    """The 413 for a body over ``limit`` bytes (``length``: its declared size)."""
    size = "" if length is None else f" ({length} bytes)"
    return OpenAIError(
        413,
        f"the request body{size} is larger than this server takes: "
        f"max_request_bytes is {limit} bytes",
        code="request_too_large",
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:  # h11 refuses it before the app; if not, count instead
                return None
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The request's whole body, at most ``limit`` bytes; ``None`` if the client hung
    up first.

    Raises:
      OpenAIError: 413, the body is longer than ``limit`` (see :func:`too_large`):
          at once when ``Content-Length`` says so, else once the bytes received pass
          it. The rest of the body is not read; answer with :func:`refuse`.
    """
    length = _content_length(scope)
    if length is not None and length > limit:
        raise too_large(limit, length)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def refuse(receive: Receive, send: Send, error: OpenAIError) -> None:
    """Answer ``error`` to a request whose body was not read to its end, and close
    the connection (``Connection: close``): the rest of the body is never read.

    Hypercorn queues a few of a request's body messages for the app (10), and stops
    reading the socket while its queue is full. The send that ends a response then
    puts ``http.disconnect`` in that queue, waiting for room: with the queue full (the
    client went on sending while the answer's head went out) and no one taking from
    it, that send would never return and the connection would never close. So while
    it runs, the messages queued are taken and dropped.
    """
    data = encode(error.body())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"connection", b"close"),
        *error.headers,
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_drop_until_disconnect, receive)
        await send({"type": "http.response.body", "body": data})
        nursery.cancel_scope.cancel()


async def _drop_until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
