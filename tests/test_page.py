"""The voice page at ``/``, in a real headless Chromium whose microphone is a WAV file
of eSpeak NG speaking: the question is heard and answered aloud, speaking over the
answer stops it, text works, a refused or ended session says why, and a pipeline
that cannot listen gets the text page.

Real parts throughout: the voice pipeline (Whisper in the listen stage's worker,
eSpeak NG speaking), server VAD, the page's AudioWorklet and Web Audio playback.
The ``page`` nox session runs this module, with Debian's chromium and
chromium-driver installed; ``OMNI_TRIO_PAGE_SHOTS=docs/images`` saves the
screenshots docs/voice.md shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from browser_helpers import (
    browser_errors,
    chromium,
    need_browser,
    shot,
    turns,
    wait_for,
    write_wav,
)
from voice_helpers import need_voice, recall, spoken

need_voice()
need_browser()

from websockets.sync.client import connect  # noqa: E402

from omni_trio.bench._voice import voice_config  # noqa: E402
from omni_trio.config import shipped_pipeline  # noqa: E402
from omni_trio.serve import RealtimeOptions  # noqa: E402
from serve_helpers import served  # noqa: E402

RATE = 24_000
QUESTION = "What is the capital city of France?"
INTERRUPTION = "Wait, stop. What time is it?"


def silence(seconds: float) -> bytes:
    return b"\x00\x00" * int(RATE * seconds)


async def in_browser(
    url: str, scenario: Callable[[Any], None], microphone: Path | None = None
) -> None:
    """Open the page at ``url`` in Chromium and run ``scenario(driver)`` (blocking,
    so in a thread); the page must have logged no error."""

    def run() -> None:
        with chromium(microphone) as driver:
            driver.get(url + "/")
            scenario(driver)
            assert not browser_errors(driver)

    await trio.to_thread.run_sync(run)


def status(driver: Any) -> str:
    state: str = driver.execute_script("return document.getElementById('status').dataset.state")
    return state


def connected(driver: Any) -> None:
    wait_for("the session", lambda: status(driver) == "connected")


def click(driver: Any, element_id: str) -> None:
    driver.find_element("id", element_id).click()


def answers(driver: Any) -> list[dict[str, str]]:
    return [t for t in turns(driver) if t["role"] == "assistant"]


def heard(driver: Any) -> list[str]:
    return [t["text"] for t in turns(driver) if t["role"] == "user" and not t["pending"]]


def played(driver: Any, count: int, ms: int) -> dict[str, str] | None:
    """Answer number ``count`` (from 1), once ``ms`` of its audio has played."""
    found = answers(driver)
    if len(found) >= count and int(found[count - 1].get("playedMs", 0)) >= ms:
        return found[count - 1]
    return None


def type_message(driver: Any, text: str) -> None:
    box = driver.find_element("id", "text")
    box.send_keys(text)
    box.submit()


def said(turn: dict[str, str]) -> str:
    return " ".join(turn["text"].split())


async def test_a_spoken_question_is_heard_and_answered_aloud(tmp_path: Path) -> None:
    microphone = write_wav(
        tmp_path / "question.wav", silence(1.0) + spoken(QUESTION, RATE) + silence(40)
    )

    def scenario(driver: Any) -> None:
        connected(driver)
        shot(driver, "voice-page-ready")
        click(driver, "mic")
        (you,) = wait_for("the question's transcript", lambda: heard(driver), 60)
        assert recall(QUESTION, you) >= 0.6, you
        answer = wait_for("two seconds of the answer played", lambda: played(driver, 1, 2000), 60)
        # The answer quotes what was heard, and its latency is shown.
        assert said(answer).startswith(f"You said: {you.strip()}"), (answer, you)
        assert 0 < int(answer["latencyMs"]) < 10_000, answer
        assert "after you stopped" in answer["meta"]
        # It plays at the pace of speech, what has come of it, no more.
        assert int(answer["playedMs"]) <= int(answer["audioMs"]), answer
        time.sleep(0.5)
        later = answers(driver)[0]
        assert 300 <= int(later["playedMs"]) - int(answer["playedMs"]) <= 700, (answer, later)
        shot(driver, "voice-page-answer")

    async with served(voice_config(), realtime=RealtimeOptions()) as (url, _):
        await in_browser(url, scenario, microphone)


async def test_speaking_over_the_answer_stops_its_playback_and_cuts_its_transcript(
    tmp_path: Path,
) -> None:
    microphone = write_wav(
        tmp_path / "barge-in.wav",
        silence(1.0)
        + spoken(QUESTION, RATE)
        # The answer (about 15 s of audio) plays; its first audio comes 1-2 s after
        # the question, up to 6 s on a crowded machine: the user speaks over it after
        # 10 s, wherever it is.
        + silence(10.0)
        + spoken(INTERRUPTION, RATE)
        + silence(40),
    )

    def scenario(driver: Any) -> None:
        connected(driver)
        click(driver, "mic")
        wait_for("the interruption's answer", lambda: played(driver, 2, 500), 90)
        first, second = answers(driver)[:2]
        barge_ins = driver.execute_script("return window.omni.bargeIns")
        # The first answer was playing when the user spoke: its playback stopped at
        # the speech_started, within 100 ms, and the server was told what was played.
        (cut,) = barge_ins
        assert cut["cause"] == "speech", barge_ins
        assert cut["itemId"] == first["itemId"], barge_ins
        assert cut["stoppedAfterMs"] <= 100, cut
        assert first["truncated"] == "true", first
        assert 1000 <= int(first["playedMs"]) < int(first["audioMs"]), first
        # Nothing more of it played after the stop.
        still = driver.execute_script(
            "return window.omni.page.player.playedMs(arguments[0])", first["itemId"]
        )
        assert still == cut["playedMs"], (still, cut)
        # Its transcript is cut to what was played; the rest shows struck through.
        assert first["unsaid"].strip(), first
        assert len(said(first).split()) < len((first["text"] + first["unsaid"]).split())
        assert "cut at" in first["meta"]
        # The interruption was heard, and answered.
        you = heard(driver)
        assert len(you) == 2, you
        assert recall(INTERRUPTION, you[1]) >= 0.5, you
        assert said(second).startswith("You said:"), second
        shot(driver, "voice-page-barge-in")

    async with served(voice_config(), realtime=RealtimeOptions()) as (url, _):
        await in_browser(url, scenario, microphone)


async def test_a_typed_message_is_answered_in_the_voice_chosen() -> None:
    def scenario(driver: Any) -> None:
        from selenium.webdriver.support.ui import Select

        connected(driver)
        Select(driver.find_element("id", "voice")).select_by_value("nova")
        wait_for(
            "the session in the voice chosen",
            lambda: (
                driver.execute_script("return window.omni.session.audio.output.voice") == "nova"
            ),
        )
        type_message(driver, "Tell me about the sea.")
        answer = wait_for("the answer played", lambda: played(driver, 1, 500), 60)
        assert said(answer).startswith("You said: Tell me about the sea."), answer
        (you,) = [t for t in turns(driver) if t["role"] == "user"]
        assert you["text"] == "Tell me about the sea."
        assert driver.find_element("id", "text").get_attribute("value") == ""

    async with served(voice_config(), realtime=RealtimeOptions()) as (url, _):
        await in_browser(url, scenario)


async def test_push_to_talk_sends_what_was_said_while_the_button_was_held(tmp_path: Path) -> None:
    microphone = write_wav(
        tmp_path / "question.wav", silence(0.5) + spoken(QUESTION, RATE) + silence(40)
    )

    def scenario(driver: Any) -> None:
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.support.ui import Select

        connected(driver)
        Select(driver.find_element("id", "mode")).select_by_value("ptt")
        wait_for(
            "server VAD off",
            lambda: driver.execute_script(
                "const s = window.omni.session; return s.audio.input.turn_detection === null"
            ),
        )
        talk = driver.find_element("id", "talk")
        assert talk.is_displayed()
        ActionChains(driver).click_and_hold(talk).pause(3.5).release(talk).perform()
        (you,) = wait_for("the question's transcript", lambda: heard(driver), 60)
        assert recall(QUESTION, you) >= 0.6, you
        answer = wait_for("the answer played", lambda: played(driver, 1, 500), 60)
        assert said(answer).startswith("You said:"), answer
        events = driver.execute_script("return window.omni.events")
        assert "input_audio_buffer.speech_started" not in events  # no server VAD
        assert "input_audio_buffer.committed" in events

    async with served(voice_config(), realtime=RealtimeOptions()) as (url, _):
        await in_browser(url, scenario, microphone)


async def test_a_refused_session_shows_why() -> None:
    def scenario(driver: Any) -> None:
        wait_for("the refusal", lambda: status(driver) == "refused")
        banner = driver.find_element("id", "banner")
        assert banner.is_displayed()
        assert "at capacity" in banner.text
        assert "--realtime-max-sessions 1" in banner.text
        assert driver.find_element("id", "reconnect").is_displayed()
        shot(driver, "voice-page-refused")

    async with served(voice_config(), realtime=RealtimeOptions(max_sessions=1)) as (url, _):
        ws_url = url.replace("http://", "ws://") + "/v1/realtime?model=voice-omni"
        held = await trio.to_thread.run_sync(connect, ws_url)  # the one session it takes
        try:
            await trio.to_thread.run_sync(held.recv, 10)  # session.created
            await in_browser(url, scenario)
        finally:
            await trio.to_thread.run_sync(held.close)


async def test_a_session_the_server_ends_says_why_and_reconnects_when_asked() -> None:
    def scenario(driver: Any) -> None:
        connected(driver)
        wait_for("the idle session's end", lambda: status(driver) == "closed", 10)
        assert "idle" in driver.find_element("id", "banner").text
        time.sleep(1.5)
        assert status(driver) == "closed"  # not tried again on its own
        click(driver, "reconnect")
        connected(driver)
        type_message(driver, "Hello again.")
        answer = wait_for(
            "the answer",
            lambda: next((a for a in answers(driver) if a.get("status") == "completed"), None),
            30,
        )
        assert said(answer).startswith("You said: Hello again."), answer

    async with served(voice_config(), realtime=RealtimeOptions(idle_timeout=2.0)) as (url, _):
        await in_browser(url, scenario)


async def test_a_pipeline_that_cannot_listen_gets_the_text_page() -> None:
    def scenario(driver: Any) -> None:
        connected(driver)
        assert "text-only" in driver.find_element("tag name", "body").get_attribute("class")
        assert not driver.find_element("id", "mic").is_displayed()
        type_message(driver, "Hello")
        wait_for(
            "the answer",
            lambda: any(a.get("status") == "completed" and a["text"] for a in answers(driver)),
            30,
        )
        shot(driver, "voice-page-text-only")

    async with served(shipped_pipeline("demo")) as (url, _):
        await in_browser(url, scenario)
