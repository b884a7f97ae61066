"""The Python examples in README.md and docs/*.md run.

Every fenced ```` ```python ```` block is run as a standalone script, in a subprocess,
from the repository root (on the full-size Python; the others compile it): so a
block must be complete (its imports, its ``trio.run(main)``), quick (a few seconds)
and need no network.

A block is a **fragment**, and is not run, when the line directly before its opening
fence is exactly ``<!-- fragment -->`` (invisible in the rendered docs; say in the
text, or in a ``# fragment: ...`` first line, that it is one). A block after
``<!-- needs the voice extra -->`` runs in the voice session only (it hears with
Whisper); every Python compiles it too. Prefer complete
examples; mark as fragments only shapes that cannot stand alone (a pattern with
placeholders, a class layout, the inside of a block).

Blocks in other languages (```` ```sh ````, ```` ```toml ````, ...) are not run. An
executed example shows no bare ``None`` output: no line it prints ends in ``None``
(a stage's completion without data is not shown to the user; see the README).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

import omni_trio
from helpers import DOCUMENTED

ROOT = Path(__file__).resolve().parent.parent
FRAGMENT = "<!-- fragment -->"
#: Before a block that needs Whisper: it runs in the voice session (``nox -s voice``).
NEEDS_VOICE = "<!-- needs the voice extra -->"
PYTHON_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
# the files whose examples the issue names: each must have at least one that runs
MUST_RUN = {"README.md", "docs/index.md", "docs/process.md", "docs/testing.md"}
TIMEOUT = 60.0  # seconds per block: generous for a loaded 2-core machine


@attrs.frozen
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    fragment: bool
    needs_voice: bool = False

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def extract_blocks(text: str, path: str = "<text>") -> list[Block]:
    """Every fenced ``python`` (or ``py``) block of a Markdown text, in order.

    Fences of any language are tracked, so a ``python`` line inside another block is
    not mistaken for a fence; an indented block (in a list item) is dedented.
    """
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = PYTHON_FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        fence, indent = match["fence"], len(match["indent"])
        start = i
        body = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence[0] * len(fence))
            and set(lines[i].strip()) == {fence[0]}
        ):
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        i += 1  # the closing fence
        if match["info"] in ("python", "py", "python3"):
            before = lines[start - 1] if start else ""
            code = "\n".join(body) + "\n"
            blocks.append(Block(path, start + 1, code, before == FRAGMENT, before == NEEDS_VOICE))
    return blocks


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [
        block
        for path in doc_files()
        for block in extract_blocks(
            path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()
        )
    ]


BLOCKS = all_blocks()
EXECUTED = [block for block in BLOCKS if not block.fragment and not block.needs_voice]
#: The examples that need Whisper: they run in the voice session.
HEARING = [block for block in BLOCKS if block.needs_voice]


@pytest.mark.parametrize("block", EXECUTED + HEARING, ids=[b.id for b in EXECUTED + HEARING])
def test_example_compiles(block: Block) -> None:
    """On every Python: what runs on one (below) is this Python's syntax too."""
    compile("\n" * block.line + block.code, block.id, "exec", dont_inherit=True)


@DOCUMENTED
@pytest.mark.parametrize("block", EXECUTED, ids=[block.id for block in EXECUTED])
def test_example_runs(block: Block, tmp_path: Path) -> None:
    run_example(block, tmp_path)


@pytest.mark.parametrize("block", HEARING, ids=[block.id for block in HEARING])
def test_an_example_that_hears_runs(block: Block, tmp_path: Path) -> None:
    """Where the voice extra is installed (``nox -s voice``)."""
    from voice_helpers import need_voice

    need_voice()
    run_example(block, tmp_path)


def run_example(block: Block, tmp_path: Path) -> None:
    """Run ``block`` as a script, from the repository root; it must succeed."""
    # padded so that a traceback's line numbers are the Markdown file's
    script = tmp_path / (re.sub(r"\W", "_", block.path) + f"_line{block.line}.py")
    script.write_text("\n" * block.line + block.code, encoding="utf-8")
    env = dict(os.environ)
    # the omni_trio under test, also in the worker processes an example starts
    src = str(Path(omni_trio.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    try:
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id}: still running after {TIMEOUT} s\n{exc.stdout}\n{exc.stderr}")
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout}\n{result.stderr}"
    if "pytest.main([__file__" in block.code:  # a test module: its tests ran, and passed
        summary = result.stdout.strip().splitlines()[-1]
        assert re.search(r"\b\d+ passed\b", summary), f"{block.id}: {summary}"
        assert not re.search(r"failed|error|skipped|deselected", summary), summary
    bare = [line for line in result.stdout.splitlines() if re.search(r"\bNone\s*$", line)]
    assert not bare, f"{block.id} prints a bare None (a completion without data): {bare}"


def test_files_named_by_the_issue_have_running_examples() -> None:
    running = {block.path for block in EXECUTED}
    assert not MUST_RUN - running, f"no executed example in {sorted(MUST_RUN - running)}"


def test_extract_blocks() -> None:
    text = "\n".join(
        [
            "# Title",
            "```python",
            "for i in [1]:",
            "    print(i)",
            "```",
            FRAGMENT,
            "```python",
            "stage.submit(...)",
            "```",
            "````text",
            "```python",
            "not a block: inside a text block",
            "```",
            "````",
            "- a list item:",
            "",
            "  ```py",
            "  if True:",
            "      print(2)",
            "  ```",
            "```sh",
            "omni-trio demo",
            "```",
            "<!-- fragment -->  ",  # not exactly the marker: runs
            "```python",
            "print(3)",
            "```",
        ]
    )
    blocks = extract_blocks(text, "x.md")
    assert [(b.line, b.code, b.fragment) for b in blocks] == [
        (2, "for i in [1]:\n    print(i)\n", False),
        (7, "stage.submit(...)\n", True),
        (17, "if True:\n    print(2)\n", False),
        (25, "print(3)\n", False),
    ]
