"""The public surface, audited: every name a public namespace exports (its
``__all__``) is documented in docs/api.md; every other module without an underscore
in its path is named in api.md's "What is not API", with why; the count api.md gives
is the code's; and what moved keeps working for one version, with a warning."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import omni_trio

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"

#: The namespaces api.md documents name by name.
NAMESPACES = [
    "omni_trio",
    "omni_trio.config",
    "omni_trio.testing",
    "omni_trio.process",
    "omni_trio.process.testing",
    "omni_trio.process.worker",
    "omni_trio.serve",
    "omni_trio.speech",
    "omni_trio.llm",
    "omni_trio.timeline",
    "omni_trio.demo.engines",
    "omni_trio.compare",
    "omni_trio.compare.plain_asyncio",
    "omni_trio.compare.asyncio_testing",
    "omni_trio.compare.scenarios",
    "omni_trio.compare.frameworks",
]

_BLOCK = re.compile(r"```\{eval-rst\}\n(.*?)```", re.S)
_DIRECTIVE = re.compile(
    r"^\.\. (?P<auto>auto)?(?P<kind>module|function|class|exception|data)::\s*(?P<name>\S+)"
)
_MEMBERS = re.compile(r"^\s+:members:\s*(?P<names>.*)")


def _documented() -> set[str]:
    """The full names docs/api.md's eval-rst blocks document (a module's
    ``:members:`` included)."""
    names: set[str] = set()
    for block in _BLOCK.finditer(API.read_text()):
        module = "omni_trio"
        automodule = False
        continued = False
        for line in block.group(1).splitlines():
            members = _MEMBERS.match(line)
            if members or (continued and line.startswith("    ") and ":" not in line):
                continued = automodule
                if automodule:
                    listed = members["names"] if members else line
                    names.update(f"{module}.{m.strip()}" for m in listed.split(",") if m.strip())
                continue
            continued = False
            directive = _DIRECTIVE.match(line)
            if directive is None:
                automodule = automodule and line.startswith(" ")
                continue
            name = directive["name"].removesuffix("()")
            if directive["kind"] == "module":
                module, automodule = name, bool(directive["auto"])
                continue
            automodule = False
            names.add(name if name.startswith("omni_trio.") else f"{module}.{name}")
    return names


def _section(title: str) -> str:
    text = API.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _public_modules() -> list[str]:
    found = ["omni_trio"]
    for info in pkgutil.walk_packages(omni_trio.__path__, "omni_trio."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            found.append(info.name)
    return found


def test_every_exported_name_is_documented():
    documented = _documented()
    missing = [
        f"{namespace}.{name}"
        for namespace in NAMESPACES
        for name in importlib.import_module(namespace).__all__
        if f"{namespace}.{name}" not in documented
    ]
    assert missing == [], f"docs/api.md documents none of {missing}"


def test_every_other_public_module_is_said_not_to_be_api():
    items = [
        line[2:].split(": ", 1)[0]
        for line in _section("What is not API").splitlines()
        if line.startswith("- ")
    ]
    said = {name for item in items for name in re.findall(r"`(omni_trio(?:\.\w+)*)`", item)}
    assert said
    unsaid = [
        name
        for name in _public_modules()
        if name not in NAMESPACES and not any(name == s or name.startswith(f"{s}.") for s in said)
    ]
    assert unsaid == [], f"api.md's 'What is not API' does not name {unsaid}"
    assert not said & set(NAMESPACES)


def test_api_md_counts_the_public_names():
    count = sum(len(importlib.import_module(n).__all__) for n in NAMESPACES)
    said = re.search(r"(\d+) public names in (\d+) namespaces", _section("What is public"))
    assert said is not None
    assert (int(said[1]), int(said[2])) == (count, len(NAMESPACES))


def test_the_ray_test_kit_where_it_lived_first_warns_and_still_works():
    import omni_trio.process
    import omni_trio.process.testing

    assert "local_ray_cluster" not in omni_trio.process.__all__
    assert "local_ray_cluster" not in dir(omni_trio.process)
    for name in ("local_ray_cluster", "LocalRayCluster"):
        with pytest.warns(omni_trio.OmniTrioDeprecationWarning, match="process.testing"):
            moved = getattr(omni_trio.process, name)
        assert moved is getattr(omni_trio.process.testing, name)
    with pytest.raises(AttributeError, match="no attribute 'MAX_FRAME'"):
        omni_trio.process.MAX_FRAME  # noqa: B018  (never documented: gone)
