"""The package's shape: which module may import which, what a worker process loads,
and the conventions of its public classes. docs/architecture.md draws the same
layers; this keeps the drawing true."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import omni_trio

PACKAGE = Path(omni_trio.__file__).parent

#: Each layer may import from the layers above it in this list, never below.
LAYERS = [
    ("foundations", {"_util", "_checks", "_errors", "_messages"}),
    ("core", {"_core"}),
    ("neutral driver", {"_sink", "_inbox", "_dispatch", "_driver", "_scripted"}),
    (
        "drivers",
        {
            "_outbox",
            "_stream",
            "_stage",
            "_orchestrator",
            "testing",
            "compare.asyncio_orchestrator",
            "compare.asyncio_testing",
            "compare.plain_asyncio",
            "compare.frameworks",
            "compare.scenarios",
        },
    ),
]
#: The process wing stands on the foundations alone (and on itself).
PROCESS_MAY_IMPORT = {"_util", "_checks", "_errors", "_messages"}
#: Configs describe process pipelines: they know the options of a worker, nothing else.
CONFIG_MAY_IMPORT = {"_util", "_checks", "process._options"}
#: The application: the command line, the demo, the benchmarks, the server. Nothing
#: else uses them.
APP = ("_cli", "__main__", "_audio", "demo", "bench", "serve", "speech")
#: What imports neither trio nor asyncio.
NEUTRAL = LAYERS[0][1] | LAYERS[1][1] | LAYERS[2][1]
LOOPS = {"trio", "asyncio", "anyio", "sniffio", "trio_util"}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path) -> tuple[set[str], set[str]]:
    """(our modules, other top-level packages) that module ``name`` imports at run time,
    anywhere in it (``if TYPE_CHECKING:`` blocks do not count)."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [part for part in package if part]
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    ours, theirs = set(), set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                top, *rest = alias.name.split(".")
                if top == "omni_trio":
                    ours.add(".".join(rest))
                else:
                    theirs.add(top)
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            module = ".".join([*base, *filter(None, (node.module or "").split("."))])
            for alias in node.names:
                submodule = f"{module}.{alias.name}".strip(".")
                ours.add(submodule if submodule in ALL else module)
        elif isinstance(node, ast.ImportFrom) and node.module:
            top, *rest = node.module.split(".")
            if top == "omni_trio":
                ours.add(".".join(rest))
            else:
                theirs.add(top)
    ours.discard("")
    return ours, theirs


ALL = modules()


def layer_of(name: str) -> int | None:
    for index, (_, members) in enumerate(LAYERS):
        if name in members:
            return index
    return None


@pytest.mark.parametrize("name", sorted(n for n in ALL if layer_of(n) is not None))
def test_imports_go_up_the_layers(name):
    ours, theirs = imports_of(name, ALL[name])
    level = layer_of(name)
    for target in ours:
        target_level = layer_of(target)
        assert target_level is not None, f"{name} imports {target}, outside the layers"
        assert target_level <= level, f"{name} ({LAYERS[level][0]}) imports {target}"
    if name in NEUTRAL:
        assert not theirs & LOOPS, f"{name} must not import an event loop"


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith("process")))
def test_the_process_wing_stands_on_the_foundations(name):
    ours, _ = imports_of(name, ALL[name])
    outside = {t for t in ours if not t.startswith("process")}
    assert outside <= PROCESS_MAY_IMPORT, f"{name} imports {outside - PROCESS_MAY_IMPORT}"


def test_configs_know_only_the_worker_options():
    ours, _ = imports_of("config", ALL["config"])
    assert ours <= CONFIG_MAY_IMPORT


@pytest.mark.parametrize("name", sorted(n for n in ALL if not n.startswith(APP)))
def test_the_library_never_imports_the_application(name):
    ours, _ = imports_of(name, ALL[name])
    assert not {t for t in ours if t.startswith(APP)}


def test_the_asyncio_drivers_import_no_trio():
    # The plain design is the twin with other hops: it stands on the twin alone.
    for name, may_use in [
        ("compare.asyncio_orchestrator", set()),
        ("compare.plain_asyncio", {"compare.asyncio_orchestrator"}),
    ]:
        ours, theirs = imports_of(name, ALL[name])
        assert "trio" not in theirs
        drivers = {t for t in ours if layer_of(t) == 3}
        assert drivers <= may_use, f"{name} must not lean on the Trio driver"


def test_a_worker_process_loads_only_what_it_needs():
    probe = (
        "import json, sys, omni_trio.process.worker; "
        "ours = [m for m in sys.modules if m.startswith(('omni_trio', 'trio_util'))]; "
        "print(json.dumps(sorted(ours)))"
    )
    loaded = json.loads(subprocess.check_output([sys.executable, "-c", probe], text=True))
    assert loaded == [
        "omni_trio",
        "omni_trio._util",
        "omni_trio.process",
        "omni_trio.process._engine",
        "omni_trio.process._links",
        "omni_trio.process._ring",
        "omni_trio.process._shm",
        "omni_trio.process._wire",
        "omni_trio.process.worker",
    ]


@pytest.mark.parametrize(
    "namespace",
    [
        "omni_trio",
        "omni_trio.process",
        "omni_trio.testing",
        "omni_trio.compare",
        "omni_trio.serve",
        "omni_trio.speech",
        "omni_trio.timeline",
    ],
)
def test_public_names_report_their_public_namespace(namespace):
    module = __import__(namespace, fromlist=["*"])
    for name in module.__all__:
        value = getattr(module, name)
        if hasattr(value, "__origin__"):  # a type alias (Engine = Callable[...]): no module
            continue
        if isinstance(value, type) or (callable(value) and hasattr(value, "__code__")):
            assert value.__module__ == namespace, name
    assert set(module.__all__) <= set(dir(module))


def test_users_get_an_orchestrator_from_its_factory():
    with pytest.raises(TypeError, match=r"omni_trio\.Orchestrator has no public constructor"):
        omni_trio.Orchestrator(None, [], max_in_flight=None, shutdown_grace=1.0)


@pytest.mark.parametrize(
    "cls",
    [
        omni_trio.Orchestrator,
        omni_trio.RequestStream,
        __import__("omni_trio.process", fromlist=["x"]).ProcessStage,
        __import__("omni_trio.process", fromlist=["x"]).WorkerOptions,
    ],
)
def test_final_classes_refuse_subclasses(cls):
    with pytest.raises(TypeError, match="does not support subclassing"):
        type("Mine", (cls,), {})


def test_the_documented_import_paths_stay():
    from omni_trio import (  # noqa: F401
        FinishReason,
        Orchestrator,
        OrchestratorStatistics,
        OrchOutput,
        RequestMetrics,
        RequestStream,
        Stage,
        StageItem,
        StageOutput,
        open_orchestrator,
    )
    from omni_trio.compare import AsyncioOrchestrator, open_asyncio_orchestrator  # noqa: F401
    from omni_trio.config import (  # noqa: F401
        ConfigError,
        PipelineConfig,
        load_pipeline,
        parse_pipeline,
    )
    from omni_trio.demo.runner import DemoOptions, run_demo  # noqa: F401
    from omni_trio.process import (  # noqa: F401
        ChunkIO,
        Engine,
        EngineRequest,
        ProcessStage,
        WorkerStartError,
        open_inprocess_stage,
        open_process_pipeline,
        open_process_stage,
    )
    from omni_trio.testing import ScriptedStage, collect_outputs  # noqa: F401
