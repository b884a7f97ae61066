"""What a new user reads first says what is so: the API reference read as plain
Markdown (its lists name every documented name, with the signature the code has),
the shipped pipelines the config page counts, ``nox -l``'s one-line descriptions,
and the extra the testing page's example needs."""

from __future__ import annotations

import ast
import inspect
import pkgutil
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"

# -- docs/api.md ------------------------------------------------------------------------

_BLOCK = re.compile(r"```\{eval-rst\}\n(.*?)```", re.S)
_DIRECTIVE = re.compile(
    r"^(?P<indent>\s*)\.\. (?P<auto>auto)?(?P<kind>module|function|class|exception|data|"
    r"method|property)::\s*(?P<name>\S+)"
)
_MEMBERS = re.compile(r"^\s+:members:\s*(?P<names>.*)")
_CODE = re.compile(r"`([^`]+)`")
_FENCED = re.compile(r"^```.*?^```", re.S | re.M)  # an example between two blocks


def _split_params(text: str) -> list[str]:
    """``a, b=(1, 2), *, c`` -> ``["a", "b", "*", "c"]``: the names, at depth 0."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current)
    return [part.split("=", 1)[0].strip() for part in parts]


def _params(obj: object) -> list[str]:
    """The names of ``obj``'s parameters, as a signature shows them (``*``, ``*args``,
    ``**kwargs``), without ``self``."""
    said: list[str] = []
    star = False
    for param in inspect.signature(obj).parameters.values():  # type: ignore[arg-type]
        if param.name in ("self", "cls"):
            continue
        if param.kind is param.KEYWORD_ONLY and not star:
            said.append("*")
            star = True
        if param.kind is param.VAR_POSITIONAL:
            said.append(f"*{param.name}")
            star = True
        elif param.kind is param.VAR_KEYWORD:
            said.append(f"**{param.name}")
        else:
            said.append(param.name)
    return said


def _documented() -> list[tuple[str, str, object, str]]:
    """Per name an eval-rst block of docs/api.md documents: how its list shows it
    (``name`` or ``.member``), the name as the directive gives it, the object, and the
    Markdown before the block (since the previous one)."""
    text = API.read_text()
    found = []
    module, start = "omni_trio", 0
    for block in _BLOCK.finditer(text):
        markdown, start = _FENCED.sub("", text[start : block.start()]), block.end()
        owner: object = None
        for line in block.group(1).splitlines():
            members = _MEMBERS.match(line)
            if members and owner is not None:
                for name in filter(None, (n.strip() for n in members["names"].split(","))):
                    shown = name if inspect.ismodule(owner) else f".{name}"
                    found.append((shown, name, getattr(owner, name), markdown))
                continue
            directive = _DIRECTIVE.match(line)
            if directive is None:
                continue
            name = directive["name"].removesuffix("()")
            if directive["kind"] == "module":
                module = name
                owner = pkgutil.resolve_name(name) if directive["auto"] else None
                continue
            if directive["indent"]:
                assert owner is not None, line
                found.append((f".{name}", name, getattr(owner, name), markdown))
                continue
            full = name if name.startswith("omni_trio.") else f"{module}.{name}"
            obj = pkgutil.resolve_name(full)
            owner = obj if directive["kind"] in ("class", "exception") else None
            found.append((name.rsplit(".", 1)[-1], name, obj, markdown))
    return found


def test_the_api_reference_lists_every_documented_name_in_markdown():
    """A Markdown viewer shows the eval-rst blocks as code: each block's names are in
    the list before it, so the page reads without Sphinx. (Adding a directive? Add
    its line to the list above its block: a signature and what it is.)"""
    documented = _documented()
    assert len(documented) > 150
    missing = []
    for shown, name, _, markdown in documented:
        spans = _CODE.findall(markdown)
        if not any(re.match(rf"(\w+\.)*{re.escape(shown)}\b(?![.\w])", s) for s in spans):
            missing.append(name)
    assert missing == [], f"docs/api.md lists none of {missing} before their directives"


def test_the_api_references_signatures_are_the_codes():
    """Each ``name(params)`` the lists show has the parameters the code has."""
    checked = 0
    wrong = []
    for shown, _, obj, markdown in _documented():
        pattern = rf"^(?:\w+\.)*{re.escape(shown)}\((.*)\)$"
        for span in _CODE.findall(markdown):
            listed = re.match(pattern, span)
            if listed is None:
                continue
            checked += 1
            if _split_params(listed[1]) != _params(obj):
                wrong.append(f"{span} (the code's: {', '.join(_params(obj))})")
    assert wrong == []
    assert checked > 80


def test_the_api_reference_has_a_heading_where_the_readme_links():
    """README's ``docs/api.md#a-configured-pipeline`` is a Markdown heading (not one
    inside an eval-rst block, which a Markdown viewer shows as code)."""
    assert "docs/api.md#a-configured-pipeline" in (ROOT / "README.md").read_text()
    assert "\n## A configured pipeline\n" in API.read_text()


# -- docs/config.md: the shipped pipelines ----------------------------------------------

_COUNT = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}


def test_the_config_page_counts_and_names_the_shipped_pipelines():
    from omni_trio.config import SHIPPED_PIPELINES

    text = (ROOT / "docs" / "config.md").read_text()
    counts = re.findall(r"\b(\w+) (?:pipelines|configs) ship\b", " ".join(text.split()))
    assert counts, "docs/config.md no longer says how many pipelines ship"
    assert {_COUNT[c.lower()] for c in counts} == {len(SHIPPED_PIPELINES)}
    intro = text.split("\n## ", 1)[0]
    assert all(f"`{name}`" in intro for name in SHIPPED_PIPELINES)


def test_the_serve_command_names_every_shipped_pipeline(capsys):
    from omni_trio.cli import main
    from omni_trio.config import SHIPPED_PIPELINES

    assert main(["serve", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    pipeline_help = shown.split("PIPELINE a TOML config", 1)[1].split("(default: demo)")[0]
    assert all(name in pipeline_help for name in SHIPPED_PIPELINES), pipeline_help


# -- noxfile.py: nox -l -----------------------------------------------------------------


def _sessions() -> list[tuple[str, str]]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return [
        (node.name, ast.get_docstring(node, clean=False) or "")
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("nox.session" in ast.unparse(d) for d in node.decorator_list)
    ]


def test_nox_lists_each_session_with_a_whole_sentence():
    """``nox -l`` shows the first line of each session's docstring (nox's
    ``SessionRunner.description``): it must be a sentence of its own, not the start
    of one cut at the line's end."""
    sessions = _sessions()
    assert len(sessions) >= 10
    for name, doc in sessions:
        first = doc.strip().split("\n")[0]  # what nox shows
        assert first.endswith("."), f"nox -l cuts {name}'s description: {first!r}"
        assert first.count("(") == first.count(")"), (name, first)
        assert first.count("``") % 2 == 0, (name, first)
        rest = doc.strip().split("\n")[1:]
        assert not rest or rest[0].strip() == "", f"{name}: a blank line after the first"


# -- docs/testing.md: the example's extra -----------------------------------------------


def test_the_testing_pages_example_says_it_needs_the_test_extra():
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text.split("### Testing your own app against a simulated pipeline", 1)[1]
    before_example = section.split("```python", 1)[0]
    assert "`test` extra" in before_example
    assert "pytest-trio" in before_example
    assert "omni-trio[test]" in before_example or ".[test]" in before_example


def test_the_test_extra_installs_what_the_example_imports():
    """The ``test`` extra the page names has pytest and pytest-trio (read plainly:
    Python 3.10 has no ``tomllib``)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = pyproject.split("\ntest = [", 1)[1].split("]", 1)[0]
    assert '"pytest>=' in extra
    assert '"pytest-trio>=' in extra
