"""The wire's vocabulary: the messages between the orchestrator's process and a stage
worker, and between two workers on a chunk link, and how each is framed. Sans-IO, as
h11's events are: no stream, no event loop -- :mod:`._framing` reads and writes these
frames on Trio streams.

Its message types are this boundary's own vocabulary; code on either side refers to
them through the module (``wire.Submit``, ``wire.Abort``), never as bare names, so a
frame is never mistaken for the core's commands or the handler's messages.

Every message is one frame: a 4-byte big-endian length, then a msgspec-msgpack body
of one of the tagged structs below. Decoding validates the whole message against the
struct types of its direction, so a frame that is not exactly one of them -- garbage,
a truncated body, a wrong field type -- raises :class:`ProtocolError`, as does a
length over the limit (checked before anything is buffered). The connection that
carried it is then closed: never a hang, never a half-understood message.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

__all__ = [
    "DECODE_FROM_WORKER",
    "DECODE_TO_READER",
    "DECODE_TO_SENDER",
    "DECODE_TO_WORKER",
    "MAX_FRAME",
    "STARTUP_TIMEOUT",
    "Abort",
    "Ack",
    "Chunk",
    "Credit",
    "Drop",
    "Failed",
    "Fatal",
    "FrameBuffer",
    "Hello",
    "Init",
    "Lost",
    "Output",
    "Ping",
    "Pong",
    "ProtocolError",
    "Ready",
    "Release",
    "Ring",
    "Route",
    "Shutdown",
    "Submit",
    "Waiting",
    "decode_frames",
    "encode",
]

#: Frames larger than this (bytes, without the 4-byte header) end the connection.
MAX_FRAME = 64 * 1024 * 1024
#: Seconds a sender waits for a stage's next worker when ``Init`` does not say
#: (``WorkerOptions.startup_timeout``'s default).
STARTUP_TIMEOUT = 30.0

_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """A frame could not be decoded, or broke the protocol; the connection is over."""


class _Message(msgspec.Struct, tag=True, array_like=True):
    pass


# -- orchestrator -> worker ---------------------------------------------------------------


class Init(_Message):
    """First frame: what the worker is and runs. ``generation`` counts the stage's
    workers (1, then 2 after a restart, ...): it makes the names of the shared-memory
    rings a worker creates, and the address it listens on, its own, never a
    predecessor's.

    ``chunks`` says the worker streams chunks (async_chunk mode with a connector):
    to the stages ``targets``, once told where their workers are (``Route``), and,
    with ``listen``, from upstream workers that connect to it (its address goes back
    in ``Ready``). A chunk of at most ``inline_chunk_bytes`` bytes travels inside its
    ``Chunk`` frame (0: none does), a bigger one through a ring of ``ring_bytes`` per
    downstream connection. A request may have ``window`` chunks, and ``window_bytes``
    bytes of inline chunks, sent and not yet acknowledged per downstream stage; its
    sender waits for more (its chunks in a ring are bounded by its share of the ring
    instead). The worker listens on a Unix socket of its host, or with
    ``listen_host``, on TCP at that address (so that workers of other hosts can
    connect; chunks then travel inline).

    ``target_labels`` and ``target_startup_timeouts`` name each stage of ``targets``
    (``stage 1 (talker)``) and say how long its sender waits for its next worker while
    it has none (its ``startup_timeout``; :data:`STARTUP_TIMEOUT` if absent) before
    the request sending fails.

    ``replica`` is the worker's replica of its stage (0 for a stage of one worker);
    ``generation`` counts the workers of all the stage's replicas together, so a
    worker's name (``_shm.worker_name``) is its own whatever its replica.
    """

    stage_id: int
    name: str
    engine: str
    engine_args: dict[str, Any]
    prefix: str
    generation: int = 1
    completion_delay: float = 0.0
    chunks: bool = False
    listen: bool = False
    targets: list[int] = []
    inline_chunk_bytes: int = 0
    ring_bytes: int = 0
    window: int = 64
    window_bytes: int = 1 << 20
    listen_host: str = ""
    target_labels: dict[int, str] = {}
    target_startup_timeouts: dict[int, float] = {}
    replica: int = 0
    sources: list[int] = []
    """The stages whose workers send it chunks (a request reads those of its
    route's, ``Submit.sources``)."""


class Submit(_Message):
    """Run a request: its envelope (:class:`~omni_trio.StageRequest`) on the wire.
    ``life`` tells a request id's lives apart on chunk links: the stages of one
    admission of a request share it, a later admission of the same id gets a greater
    one (the orchestrator core's admission number)."""

    request_id: str
    inputs: Any
    life: int = 0
    outputs: int = 0
    """Flow control: the request may have this many ``Output`` frames sent before it
    gets more credit (``Credit``); 0: no flow control for it (not a final stage of
    it, or an orchestrator that gives none)."""
    nbytes: int = 0
    """...and this many bytes of their data (``bytes`` and ``str`` count their length,
    anything else 0); an output bigger than what is left goes once at least half of
    this is."""
    replicas: dict[int, int] = {}
    """Which replica of each downstream stage reads this request's chunks (a stage
    not named: replica 0)."""
    sources: list[int] | None = None
    """The stages whose chunks it reads on its route (``[]``: none, it entered here:
    its chunk stream is empty); ``None``: its upstream's."""
    targets: list[int] | None = None
    """The stages its chunks go to on its route (a subset of the worker's targets);
    ``None``: all of them."""
    priority: int = 0
    """The envelope's priority (lower first); engines may read it from
    ``io.priority``."""


class Credit(_Message):
    """The request's consumer took outputs: it may send ``outputs`` more, of ``nbytes``
    more bytes (ignored for a request the worker does not run)."""

    request_id: str
    outputs: int
    nbytes: int


class Abort(_Message):
    request_id: str


class Release(_Message):
    request_id: str


class Ping(_Message):
    seq: int


class Shutdown(_Message):
    pass


class Route(_Message):
    """Send your chunks for stage ``stage_id``'s replica ``replica`` to the worker
    listening at ``address``
    (a new address: a new worker; a request whose chunks went to the previous one is
    lost there). An empty address: that stage has no worker right now, so senders
    wait; ``gone``: it will have none again, so its chunks are dropped."""

    stage_id: int
    address: str
    gone: bool = False
    replica: int = 0
    """Which of that stage's replicas (0 for a stage of one worker)."""


# -- worker -> orchestrator ---------------------------------------------------------------


class Ready(_Message):
    """The worker is serving; ``address``: where upstream workers connect to send it
    chunks (empty unless ``Init.listen``)."""

    pid: int
    address: str = ""


class Fatal(_Message):
    """The worker cannot go on (its engine failed to load, or it broke down)."""

    message: str


class Output(_Message):
    """An output of the request's life ``life`` (its ``Submit``'s): a peer that has
    released that life, or submitted a later one of the id, drops it. ``meta``: what
    the engine said about ``data`` beside it (``Last(data, meta=...)``)."""

    request_id: str
    data: Any
    finished: bool
    life: int = 0
    meta: dict[str, Any] | None = None


class Failed(_Message):
    request_id: str
    error: str
    life: int = 0


class Pong(_Message):
    """The answer to ``Ping(seq)``, and the sizes of the worker's per-request tables
    at that moment (0 from a worker that does not say):

    ``requests``: requests it knows (running, ended and not yet released, or known by
    their chunks alone); ``chunks_waiting``: notices in their inboxes (chunks not yet
    read, ends of stream, losses); ``chunks_held``, ``chunk_bytes_held``: chunks
    taken for requests not running there (copied out and acknowledged, kept for a
    ``Submit`` or until a ``Drop``); ``chunks_unacked``, ``chunk_bytes_unacked``:
    chunks it sent downstream that are not acknowledged yet, and the bytes of those
    that went inline; ``requests_written``: requests it sent chunks of downstream
    and has not released; ``acks_owed``: requests whose acknowledgements it owes
    its upstream workers (batched, or asked for by a waiting sender);
    ``ring_bytes_in_use``: of its rings to the workers downstream;
    ``engines_waiting``: engines waiting at its gate to compute, by priority;
    ``slots_waiting``: requests waiting for a slot of the engine's own (an engine
    with a ``slots`` attribute).
    """

    seq: int
    requests: int = 0
    chunks_waiting: int = 0
    chunks_held: int = 0
    chunk_bytes_held: int = 0
    chunks_unacked: int = 0
    chunk_bytes_unacked: int = 0
    requests_written: int = 0
    acks_owed: int = 0
    ring_bytes_in_use: int = 0
    engines_waiting: int = 0
    slots_waiting: int = 0


# -- a chunk link (a sending worker <-> a reading worker) -----------------------------------


class Hello(_Message):
    """First frame on a chunk link: it comes from stage ``stage_id``'s worker
    number ``generation``."""

    stage_id: int
    generation: int


class Ring(_Message):
    """The sender's shared-memory ring for chunks too big to travel inline; ``Chunk``
    frames with an ``offset`` that follow are in it."""

    name: str


class Chunk(_Message):
    """The ``seq``-th chunk of a request (from 0), ``size`` bytes: in ``data``, or in
    the sender's ring at ``offset``. ``eos`` says the request's upstream is done,
    after ``seq`` chunks: a reader that saw fewer lost some. ``life``: the
    ``Submit.life`` of the request at its sender (``Lost`` and ``Drop`` carry it
    too): a reader never takes a chunk of an id's earlier life as its own.
    ``source``: the sender's stage (``Lost`` carries it too): a stage that reads
    several keeps a stream, a window and its losses per source."""

    request_id: str
    seq: int
    size: int = 0
    data: bytes | None = None
    offset: int = -1
    eos: bool = False
    life: int = 0
    source: int = -1


class Lost(_Message):
    """Chunks of ``request_id`` may be missing: they went to a reading worker that
    died (sent first on the link to its successor)."""

    request_id: str
    reason: str
    life: int = 0
    source: int = -1


class Waiting(_Message):
    """The sender waits for acknowledgements of ``request_id``'s chunks (its window
    is full): the reader sends what it owes at once, and from then on as it reads."""

    request_id: str


class Drop(_Message):
    """The sender released ``request_id``: a reader that never ran it can forget it."""

    request_id: str
    life: int = 0


class Ack(_Message):
    """From the reader: ``counts[request_id]`` more of the request's chunks were read
    (or dropped), and the ring slots at ``slots`` are free again."""

    counts: dict[str, int]
    slots: list[int]


ToWorker = Init | Submit | Credit | Abort | Release | Ping | Shutdown | Route
FromWorker = Ready | Fatal | Output | Failed | Pong
ToReader = Hello | Ring | Chunk | Lost | Drop | Waiting

_encoder = msgspec.msgpack.Encoder()
DECODE_TO_WORKER = msgspec.msgpack.Decoder(ToWorker)
DECODE_FROM_WORKER = msgspec.msgpack.Decoder(FromWorker)
DECODE_TO_READER = msgspec.msgpack.Decoder(ToReader)
DECODE_TO_SENDER = msgspec.msgpack.Decoder(Ack)


def encode(message: _Message) -> bytearray:
    """One frame. Raises ``TypeError`` for data msgpack cannot carry, and
    :class:`ProtocolError` if the frame would exceed :data:`MAX_FRAME`."""
    frame = bytearray(_HEADER.size)  # the body is encoded after it: one copy, not two
    _encoder.encode_into(message, frame, _HEADER.size)
    length = len(frame) - _HEADER.size
    if length > MAX_FRAME:
        raise ProtocolError(f"a {length}-byte frame exceeds the {MAX_FRAME}-byte limit")
    _HEADER.pack_into(frame, 0, length)
    return frame


class FrameBuffer:
    """Bytes in, whole frames out: a connection's receive side without the connection.

    :meth:`feed` what arrived, then take every complete frame, decoded and validated,
    with :meth:`frames`; a frame cut off stays buffered until the rest comes.
    """

    __slots__ = ("_buffer", "_decoder", "_max_frame")

    def __init__(
        self, decoder: msgspec.msgpack.Decoder[Any], *, max_frame: int = MAX_FRAME
    ) -> None:
        self._decoder = decoder
        self._max_frame = max_frame
        self._buffer = bytearray()

    def __len__(self) -> int:
        """Bytes received and not yet part of a whole frame."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buffer += data

    def frames(self) -> list[Any]:
        """Every whole frame buffered, decoded, in order (``[]``: none yet).

        Raises:
          ProtocolError: a frame is malformed or announces more than ``max_frame``.
        """
        buffer = self._buffer
        frames = []
        offset = 0
        while len(buffer) - offset >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer, offset)
            if length > self._max_frame:
                raise ProtocolError(
                    f"a frame announced {length} bytes, over the {self._max_frame}-byte limit"
                )
            end = offset + _HEADER.size + length
            if len(buffer) < end:
                break
            try:
                frames.append(self._decoder.decode(memoryview(buffer)[offset + _HEADER.size : end]))
            except msgspec.MsgspecError as exc:
                raise ProtocolError(f"a malformed frame: {exc}") from None
            offset = end
        if offset:
            del buffer[:offset]
        return frames


def decode_frames(data: bytes, decoder: msgspec.msgpack.Decoder[Any]) -> list[Any]:
    """Every whole frame in ``data``, decoded (what a frame writer took)."""
    frames = FrameBuffer(decoder)
    frames.feed(data)
    return frames.frames()
