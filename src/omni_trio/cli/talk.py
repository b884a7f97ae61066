"""``omni-trio talk [URL]``: one turn on a running server's ``/v1/realtime``, spoken
(``--wav``) or typed (``--text``); both transcripts printed with their timings, the
answer's audio saved with ``--save``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ._common import Commands, UsageError, fail, importable, positive_number

if TYPE_CHECKING:
    from ..serve._talk import Turn

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    talk = commands.add_parser(
        "talk",
        help="say one turn to a running omni-trio serve, and hear its answer (the serve extra)",
        description="Open a session on URL's /v1/realtime (default http://127.0.0.1:8000), "
        "say one turn -- an audio file of any format FFmpeg reads, resampled to the API's "
        "24 kHz, with a second of silence after it so the server's voice activity "
        "detection ends the turn; or typed text -- and print what the server heard, the "
        "answer's transcript, and how long each took. Exit 0 once the response is done; "
        "1 when the server cannot be reached, refuses, fails or is too slow; 2 for a bad "
        "argument or a file that is not audio. See docs/voice.md.",
    )
    talk.add_argument("url", metavar="URL", nargs="?", default="http://127.0.0.1:8000")
    said = talk.add_mutually_exclusive_group(required=True)
    said.add_argument("--wav", metavar="FILE", type=Path, help="the turn, spoken: an audio file")
    said.add_argument("--text", metavar="TEXT", help="the turn, typed")
    talk.add_argument("--save", metavar="FILE", type=Path, help="save the answer's audio (WAV)")
    talk.add_argument("--model", help="the model to ask (default: the one the server serves)")
    talk.add_argument(
        "--timeout",
        type=positive_number,
        default=60.0,
        metavar="SECONDS",
        help="give up on an answer not done within this long (default 60)",
    )
    talk.set_defaults(run=_talk, check=_check)


def _check(args: argparse.Namespace) -> None:
    missing = [m for m in ("h11", "wsproto", "av") if not importable(m)]
    if missing:
        raise UsageError(
            f"needs the serve extra ({', '.join(missing)} missing): pip install 'omni-trio[serve]'"
        )
    from ..serve._client import ClientError, Server

    try:
        args.server = Server.of(args.url)
    except ClientError as exc:
        raise UsageError(f"URL: {exc}") from None
    if args.text is not None and not args.text.strip():
        raise UsageError("--text must not be empty")
    args.pcm = None
    if args.wav is not None:
        from ..serve._audio_in import NotAudioError
        from ..serve._talk import spoken_pcm

        try:
            data = args.wav.read_bytes()
        except OSError as exc:
            raise UsageError(f"--wav: cannot read {str(args.wav)!r}: {exc.strerror}") from None
        try:
            args.pcm = spoken_pcm(data)
        except NotAudioError as exc:
            raise UsageError(f"--wav: {str(args.wav)!r}: {exc}") from None


def _talk(args: argparse.Namespace) -> int:
    import trio

    from ..serve._client import ClientError

    try:
        turn = trio.run(_talk_main, args)
    except ClientError as exc:
        return fail(f"omni-trio talk: {exc}", 1)
    if turn is None:
        return fail(f"omni-trio talk: no answer within {args.timeout:g} s (--timeout)", 1)
    if args.save is not None:
        from .._audio import wav_bytes
        from ..serve._talk import RATE

        try:
            args.save.write_bytes(wav_bytes(turn.audio, RATE))
        except OSError as exc:
            return fail(f"omni-trio talk: --save: cannot write {str(args.save)!r}: {exc}", 1)
        print(f"saved {args.save} ({len(turn.audio) / 2 / RATE:.1f} s of audio)")
    return 0


async def _talk_main(args: argparse.Namespace) -> Turn | None:
    import trio

    from ..serve._talk import talk

    def said(what: str, turn: Turn) -> None:
        if what == "heard":
            print(f"you{_after(turn.heard_after, 'heard')}: {turn.heard}", flush=True)
        elif what == "done":
            timings = ", ".join(
                f"{name} {seconds:.2f} s"
                for name, seconds in (
                    ("first audio", turn.first_audio),
                    ("first text", turn.first_text if turn.first_audio is None else None),
                    ("done", turn.done),
                )
                if seconds is not None
            )
            print(f"assistant ({timings}, after you stopped): {turn.answer}", flush=True)

    with trio.move_on_after(args.timeout):
        return await talk(
            args.server, pcm=args.pcm, text=args.text, model=args.model, on_event=said
        )
    return None


def _after(seconds: float | None, what: str) -> str:
    return "" if seconds is None else f" ({what} {seconds:.2f} s after you stopped)"
