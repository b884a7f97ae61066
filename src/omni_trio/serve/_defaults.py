"""The server's defaults, in a module that imports nothing: ``omni-trio serve --help``
shows them without the serve extra, and the server, its app and
:class:`~omni_trio.serve.RealtimeOptions` take theirs from here, so each is written
once."""

from __future__ import annotations

__all__ = [
    "HOST",
    "MAX_AUDIO_SECONDS",
    "MAX_REQUEST_BYTES",
    "MAX_WAITING",
    "PORT",
    "REALTIME_IDLE_TIMEOUT",
    "REALTIME_MAX_BUFFER_SECONDS",
    "REALTIME_MAX_EVENT_BYTES",
    "REALTIME_MAX_SESSIONS",
    "WRITE_TIMEOUT",
]

#: Where the server listens: loopback only, unless asked.
HOST = "127.0.0.1"
PORT = 8000
#: Seconds a client may leave the server's writes unread (its receive window shut)
#: before the kernel drops its connection: longer than the default
#: ``consumer_idle_timeout`` (60 s), so that a silent client's request ends with its
#: error terminal first.
WRITE_TIMEOUT = 75.0
#: Requests that may wait for a ``max_in_flight`` slot before more get 503.
MAX_WAITING = 64
#: The largest request body the server reads (1 MiB).
MAX_REQUEST_BYTES = 1024 * 1024
#: The longest audio a transcription takes.
MAX_AUDIO_SECONDS = 300.0
#: Realtime sessions at once.
REALTIME_MAX_SESSIONS = 16
#: The input audio a realtime session may buffer uncommitted, in seconds.
REALTIME_MAX_BUFFER_SECONDS = 60.0
#: The largest realtime client event.
REALTIME_MAX_EVENT_BYTES = 1024 * 1024
#: Seconds a realtime session may go with no client event (and no response streaming).
REALTIME_IDLE_TIMEOUT = 300.0
