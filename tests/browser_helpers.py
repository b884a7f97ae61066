"""A real headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by
Selenium) for the voice page's tests, its microphone a WAV file.

Chromium's fake capture device plays ``--use-file-for-fake-audio-capture`` as the
microphone from the moment the page opens it; the page's permission prompt is
answered by ``--use-fake-ui-for-media-stream``. Selenium is given both binaries, so
its manager never looks for (or downloads) a browser.
"""

from __future__ import annotations

import os
import shutil
import time
import wave
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

#: ``OMNI_TRIO_REQUIRE_BROWSER=1``: a missing browser fails the tests instead of
#: skipping them (the ``page`` nox session installs it, and must not skip).
REQUIRE_BROWSER = os.environ.get("OMNI_TRIO_REQUIRE_BROWSER") == "1"
#: ``OMNI_TRIO_PAGE_SHOTS=DIR``: the tests save a screenshot of each state there
#: (docs/images/ holds the ones docs/voice.md shows).
SHOTS = os.environ.get("OMNI_TRIO_PAGE_SHOTS")
T = TypeVar("T")


def need_browser() -> None:
    """Skip the calling module unless Chromium, ChromeDriver and Selenium are here;
    with :data:`REQUIRE_BROWSER`, fail instead."""
    import importlib.util

    missing = [
        name
        for name, there in [
            ("chromium", shutil.which("chromium") is not None),
            ("chromedriver", shutil.which("chromedriver") is not None),
            ("selenium", importlib.util.find_spec("selenium") is not None),
        ]
        if not there
    ]
    if not missing:
        return
    message = (
        f"no {', '.join(missing)} (apt-get install chromium chromium-driver; pip install selenium)"
    )
    if REQUIRE_BROWSER:
        pytest.fail(f"{message} (and OMNI_TRIO_REQUIRE_BROWSER=1)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def write_wav(path: Path, pcm: bytes, rate: int = 24_000) -> Path:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm)
    return path


@contextmanager
def chromium(microphone: Path | None = None) -> Iterator[Any]:
    """A headless Chromium whose microphone plays ``microphone`` once (silence without)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never download a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for argument in [
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--window-size=960,760",
        "--autoplay-policy=no-user-gesture-required",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
    ]:
        options.add_argument(argument)
    if microphone is not None:
        options.add_argument(f"--use-file-for-fake-audio-capture={microphone}%noloop")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 30.0) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def turns(driver: Any) -> list[dict[str, str]]:
    """The page's turns: ``role``, ``text`` (what was said: an answer cut short
    holds what was played), ``unsaid`` and each ``data-`` attribute (camelCase)."""
    found: list[dict[str, str]] = driver.execute_script(
        """return [...document.querySelectorAll('.turn')].map(e => ({
            role: e.classList.contains('user') ? 'user' : 'assistant',
            pending: e.classList.contains('pending') ? 'yes' : '',
            text: e.querySelector('.text').textContent,
            unsaid: (e.querySelector('.unsaid') || {textContent: ''}).textContent,
            meta: e.querySelector('.meta').textContent,
            ...e.dataset}))"""
    )
    return found


def shot(driver: Any, name: str) -> None:
    """Save a screenshot as ``SHOTS/name.png`` (when :data:`SHOTS` is set)."""
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SHOTS) / f"{name}.png"))


def browser_errors(driver: Any) -> list[str]:
    """The page's console errors (a script that threw), beside the expected ones."""
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and "/v1/realtime" not in entry["message"]
    ]
