"""The package's shape: which module may import which, what a worker process loads,
and the conventions of its public classes and namespaces. docs/architecture.md
draws the same layers; this keeps the drawing true."""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TypeAlias

import attrs
import pytest

import omni_trio
from omni_trio import OmniTrioDeprecationWarning, open_orchestrator
from omni_trio.process import open_process_stage
from processes import worker_processes

PACKAGE = Path(omni_trio.__file__).parent
TOOLS = PACKAGE.parents[1] / "tools"

FOUNDATIONS = {"_util", "_checks", "_errors", "_messages", "_graph", "_priority"}
#: omni_trio.testing's simulator (its _scripted stage is a driver's).
SIMULATION = [
    "_sim_engines", "_faults", "_invariants", "_network", "_scheduler",
    "_simulation", "_streams", "_trace", "_workload",
]  # fmt: skip


@attrs.frozen
class Layer:
    name: str
    #: Module names (relative to omni_trio; fnmatch patterns; "" is omni_trio itself).
    modules: frozenset[str]
    #: The layers it may import from (always lower ones), besides its own.
    uses: frozenset[str]


#: A layer's ``uses`` that names every layer below it.
BELOW = "every layer below"


def layer(name: str, modules: set[str], uses: set[str] | str = frozenset()) -> Layer:
    return Layer(name, frozenset(modules), frozenset({uses} if isinstance(uses, str) else uses))


#: Every module of the package, in layers, lowest first. A module may import from its
#: own layer and the layers its layer ``uses``, which are all lower: so no import,
#: ``if TYPE_CHECKING:`` ones included, runs from a lower layer to a higher one. A
#: public namespace (a package's ``__init__``, which re-exports lazily) sits in the
#: layer of the highest module it names.
LAYERS = [
    layer("foundations", FOUNDATIONS),
    # The worker side of the process boundary: what a worker process runs.
    layer("worker", {"process.worker", "process.worker.*"}, {"foundations"}),
    layer("core", {"_core", "_decisions"}, {"foundations"}),
    layer(
        "neutral driver",
        {"_sink", "_flow", "_inbox", "_dispatch", "_driver", "_scripted_base"},
        {"foundations", "core"},
    ),
    layer(
        "drivers",
        {"_outbox", "_stream", "_stage_protocol", "_orchestrator", "_slots", "testing._scripted"}
        | {"compare", "compare.*"},
        {"foundations", "core", "neutral driver"},
    ),
    # How a worker is run: the config's [stages.runtime], below configs and the
    # supervisor alike.
    layer("worker options", {"process._options"}, {"foundations"}),
    # The supervisor side of the process boundary: stages, connections, launchers.
    layer(
        "supervisor",
        {
            "process._launcher",
            "process._process_launcher",
            "process._task_launcher",
            "process._ray_session",
            "process._ray_launcher",
            "process._connection",
            "process._placement",
            "process._connector",
            "process._replica",
            "process._stage",
            "process._open",
            "process.testing",
        },
        {"foundations", "worker", "worker options"},
    ),
    # A config's defaults are the orchestrator's (the core's and the flow's bounds)
    # and the workers' own.
    layer("configs", {"config"}, {"foundations", "core", "neutral driver", "worker options"}),
    # A configured pipeline: its stages (_process_pipeline, open_process_pipeline),
    # and the orchestrator over them (_pipeline, omni_trio.open_pipeline). They read
    # a config, so they sit above it, outside process/: the process wing is below.
    layer("pipelines", {"_process_pipeline", "_pipeline", "process", ""}, BELOW),
    # The simulator runs whole pipelines, and omni_trio.testing offers it.
    layer("simulation", {"testing", *(f"testing.{m}" for m in SIMULATION)}, BELOW),
    layer("timelines", {"timeline"}, {"foundations"}),
    # The application: the command line, the demo, the benchmarks, the server, the
    # speech engines. Nothing of the library uses it.
    layer(
        "application",
        {
            "cli",
            "cli.*",
            "__main__",
            "_audio",
            "_conversation",
            "_runtime",
            "demo",
            "demo.*",
            "bench",
            "bench.*",
            "serve",
            "serve.*",
            "speech",
            "speech.*",
            "llm",
            "llm.*",
        },
        BELOW,
    ),
]
LAYERS = [
    attrs.evolve(each, uses=frozenset(lower.name for lower in LAYERS[:index]))
    if BELOW in each.uses
    else each
    for index, each in enumerate(LAYERS)
]
#: What imports neither trio nor asyncio.
NEUTRAL = {"foundations", "core", "neutral driver", "worker options", "configs", "timelines"}
LOOPS = {"trio", "asyncio", "anyio", "sniffio", "trio_util"}


Graph: TypeAlias = Mapping[str, Iterable[str]]


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


ALL = modules()


def exports_of(name: str) -> dict[str, str]:
    """A public namespace's lazy table: each name it exports -> the module defining it
    (``{}`` for a module that is not one)."""
    path = ALL.get(name)
    if path is None or path.name != "__init__.py":
        return {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            table = ast.literal_eval(node.value)
            base = f"omni_trio.{name}".rstrip(".")
            return {
                exported: importlib.util.resolve_name(module, base).removeprefix("omni_trio.")
                for module, names in table.items()
                for exported in names
            }
    return {}


def resolve(module: str, names: list[str]) -> set[str]:
    """What ``from omni_trio.<module> import <names>`` imports, as our modules: a
    submodule itself, a name of a public namespace's lazy table its module, any other
    name ``module``."""
    found = set()
    table = exports_of(module)
    for name in names:
        submodule = f"{module}.{name}".strip(".")
        if submodule in ALL:
            found.add(submodule)
        elif name in table:
            found.add(table[name])
        else:
            found.add(module)
    return found


def imports_of(name: str, path: Path) -> tuple[set[str], set[str]]:
    """(our modules, other top-level packages) that module ``name`` imports, anywhere
    in it, ``if TYPE_CHECKING:`` blocks included."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [part for part in package if part]
    ours, theirs = set(), set()
    for node in ast.walk(tree):
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
            ours |= resolve(module, [alias.name for alias in node.names])
        elif isinstance(node, ast.ImportFrom) and node.module:
            top, *rest = node.module.split(".")
            if top == "omni_trio":
                ours |= resolve(".".join(rest), [alias.name for alias in node.names])
            elif top != "__future__":
                theirs.add(top)
    ours.discard(name)
    return ours, theirs


def layer_of(name: str) -> Layer | None:
    for each in LAYERS:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in each.modules):
            return each
    return None


def test_every_module_is_in_one_layer():
    for name in ALL:
        assert layer_of(name) is not None, f"omni_trio.{name} is in no layer"
        found = [
            each.name
            for each in LAYERS
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in each.modules)
        ]
        assert len(found) == 1, f"omni_trio.{name} is in several layers: {found}"


def test_layers_only_use_lower_layers():
    below: set[str] = set()
    for each in LAYERS:
        assert each.uses <= below, f"{each.name} uses {sorted(each.uses - below)}, not below it"
        below.add(each.name)


@pytest.mark.parametrize("name", sorted(ALL))
def test_imports_go_down_the_layers(name):
    ours, theirs = imports_of(name, ALL[name])
    own = layer_of(name)
    assert own is not None
    for target in sorted(ours):
        target_layer = layer_of(target)
        assert target_layer is not None, f"{name} imports {target}, which is no module of ours"
        assert target_layer is own or target_layer.name in own.uses, (
            f"{name} ({own.name}) imports {target} ({target_layer.name})"
        )
    if own.name in NEUTRAL:
        assert not theirs & LOOPS, f"{name} must not import an event loop"


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith("process.worker")))
def test_the_worker_side_imports_only_itself_and_the_foundations(name):
    ours, _ = imports_of(name, ALL[name])
    outside = {t for t in ours if layer_of(t).name != "worker"}
    assert outside <= FOUNDATIONS, f"{name} imports {sorted(outside - FOUNDATIONS)}"


def test_the_asyncio_drivers_import_no_trio():
    # The plain design is the twin with other hops: it stands on the twin alone.
    for name, may_use in [
        ("compare.asyncio_orchestrator", set()),
        ("compare.plain_asyncio", {"compare.asyncio_orchestrator"}),
    ]:
        ours, theirs = imports_of(name, ALL[name])
        assert "trio" not in theirs
        drivers = {t for t in ours if layer_of(t).name == "drivers"}
        assert drivers <= may_use, f"{name} must not lean on the Trio driver"


def test_the_layout_check_sees_typing_only_imports(tmp_path):
    # ``if TYPE_CHECKING:`` imports count: a config that named an orchestrator type
    # there would be an import running back up.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from omni_trio import Orchestrator\n"
        "    from .process._stage import ProcessStage\n"
    )
    ours, _ = imports_of("config", probe)
    assert ours == {"_orchestrator", "process._stage"}


def test_the_process_wing_sits_below_the_configs():
    # process/ is the worker, its options and the supervisor: a config reads a
    # worker's options, and what opens stages from a config (_process_pipeline)
    # sits beside open_pipeline. Only the namespace, which names it, is above.
    order = [each.name for each in LAYERS]
    configs = order.index("configs")
    for name in ALL:
        if name.startswith("process."):
            own = layer_of(name)
            assert own is not None
            assert order.index(own.name) < configs, f"omni_trio.{name} is in {own.name}"


# -- no circles -------------------------------------------------------------------------


def import_graph() -> dict[str, set[str]]:
    """Each module of ours -> the modules of ours it imports, anywhere in it
    (``if TYPE_CHECKING:`` blocks and function bodies included)."""
    return {name: imports_of(name, path)[0] & ALL.keys() for name, path in ALL.items()}


def _components(graph: Graph) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's, without
    recursion): each a list of nodes that all reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(sorted(component))
    return found


def _shortest_circle(graph: Graph, start: str, within: set[str]) -> list[str]:
    """The shortest way from ``start`` back to itself inside ``within`` (breadth
    first), as ``[start, ..., start]``."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        after = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [node]  # back to start, one step at a time
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target in within and target not in came_from:
                    came_from[target] = node
                    after.append(target)
        frontier = after
    raise AssertionError(f"{start} is on no circle")  # pragma: no cover


def circles(graph: Graph) -> list[list[str]]:
    """One circle of imports per knot in ``graph`` (each group of modules that
    all import each other, through however many steps): its shortest circle
    through its first module, ``[a, b, ..., a]``. ``[]``: the graph has none."""
    found = []
    for component in _components(graph):
        if len(component) > 1 or component[0] in graph[component[0]]:
            found.append(_shortest_circle(graph, component[0], set(component)))
    return found


def test_no_modules_import_each_other_in_a_circle():
    # Layers allow imports within a layer; this allows no circle there either, not
    # even through ``if TYPE_CHECKING:`` or a function-local import: every module
    # can be read, and replaced, after the ones it uses.
    knots = circles(import_graph())
    assert knots == [], "imports in a circle (TYPE_CHECKING and function-local ones count): " + (
        "; ".join(" -> ".join(f"omni_trio.{name}" for name in knot) for knot in knots)
    )


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
        # the shortest circle through the knot's first module, and one per knot
        (
            {"a": {"b"}, "b": {"c", "a"}, "c": {"d"}, "d": {"a"}, "x": {"y"}, "y": {"x"}},
            [["a", "b", "a"], ["x", "y", "x"]],
        ),
        ({"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}, [["b", "c", "d", "b"]]),
        ({"a": {"a"}}, [["a", "a"]]),
    ],
)
def test_the_circle_check_finds_every_knot(graph, expected):
    assert sorted(circles(graph)) == expected


def test_the_circle_check_sees_typing_only_and_function_local_imports(tmp_path):
    # A circle closed through ``if TYPE_CHECKING:`` (or an import in a function,
    # made late to dodge the circle at import time) is a circle all the same.
    sink = tmp_path / "sink.py"
    sink.write_text("from ._flow import FlowLedger\n")
    flow = tmp_path / "flow.py"
    flow.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ._sink import OutboxBase\n"
        "def later():\n"
        "    from .process.worker._worker import serve\n"
    )
    graph = {"_sink": imports_of("_sink", sink)[0], "_flow": imports_of("_flow", flow)[0]}
    assert graph["_flow"] == {"_sink", "process.worker._worker"}
    assert circles({**graph, "process.worker._worker": set()}) == [["_flow", "_sink", "_flow"]]


# -- what a worker process loads ----------------------------------------------------------

#: Ours that a worker may load besides its own package: the foundations, and the
#: namespaces on the way to it (which load nothing eagerly).
WORKER_MAY_LOAD = {f"omni_trio.{m}" for m in FOUNDATIONS} | {"omni_trio", "omni_trio.process"}


def _ours_loaded(names):
    return sorted(m for m in names if m == "omni_trio" or m.startswith("omni_trio."))


def test_the_worker_package_loads_only_itself_and_the_foundations():
    probe = (
        "import json, sys; from omni_trio.process.worker import _main; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = _ours_loaded(json.loads(subprocess.check_output([sys.executable, "-c", probe])))
    outside = [
        m
        for m in loaded
        if m not in WORKER_MAY_LOAD and not m.startswith("omni_trio.process.worker")
    ]
    assert "omni_trio.process.worker._worker" in loaded
    assert outside == []


async def test_a_serving_worker_process_has_loaded_only_the_worker_side():
    """The real thing: a worker process that loaded its engine, served requests and
    streamed, asked what of ours it has loaded."""
    async with (
        open_process_stage("process_engines:loaded_modules") as stage,
        open_orchestrator([stage], {0}, forward_fn=lambda sid, outputs: outputs) as orch,
        orch.open_request(None) as stream,
    ):
        assert stage.pid in worker_processes()
        outputs = [out async for out in stream]
    loaded = _ours_loaded(outputs[0].data)
    assert "omni_trio.process.worker._worker" in loaded  # it looked where the code is
    outside = [
        m
        for m in loaded
        if m not in WORKER_MAY_LOAD and not m.startswith("omni_trio.process.worker")
    ]
    assert outside == [], f"a worker process loaded {outside}"


# -- conventions ----------------------------------------------------------------------------

NAMESPACES = [
    "omni_trio",
    "omni_trio.process",
    "omni_trio.process.worker",
    "omni_trio.testing",
    "omni_trio.compare",
    "omni_trio.serve",
    "omni_trio.speech",
    "omni_trio.timeline",
]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_public_names_report_their_public_namespace(namespace):
    module = __import__(namespace, fromlist=["*"])
    for name in module.__all__:
        value = getattr(module, name)
        if hasattr(value, "__origin__"):  # a type alias (Engine = Callable[...]): no module
            continue
        if isinstance(value, type) or (callable(value) and hasattr(value, "__code__")):
            assert value.__module__ == namespace, name
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize("name", sorted(n for n in ALL if exports_of(n)))
def test_a_namespace_spells_out_what_its_lazy_table_exports(name):
    """Each public name is written twice, for type checkers (``if TYPE_CHECKING:``,
    ``from .m import X as X``) and in ``_EXPORTS``: both name the same objects."""
    tree = ast.parse(ALL[name].read_text())
    spelled = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom):
                    for alias in inner.names:
                        assert alias.asname == alias.name, f"{name}: import {alias.name} as itself"
                        base = f"omni_trio.{name}".rstrip(".")
                        module = importlib.util.resolve_name(
                            "." * inner.level + (inner.module or ""), base
                        )
                        spelled.add((alias.name, module.removeprefix("omni_trio.")))
    assert spelled == set(exports_of(name).items())


def _sources():
    yield from ((f"omni_trio.{name}".rstrip("."), path) for name, path in ALL.items())
    yield from ((f"tools.{path.stem}", path) for path in sorted(TOOLS.glob("*.py")))


def _is_module(module: str, name: str) -> bool:
    full = f"{module}.{name}"
    if full.startswith("omni_trio."):
        return full.removeprefix("omni_trio.") in ALL
    try:
        return importlib.util.find_spec(full) is not None
    except (ImportError, ValueError):
        return False


def test_no_private_name_is_imported_across_modules():
    """ruff's SLF001 sees ``obj._private``; this sees ``from module import _private``
    (a module of ours, ``from . import _wire``, is a module and not a name)."""
    found = []
    for importer, path in _sources():
        is_package = path.name == "__init__.py"
        package = importer if is_package else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *filter(None, (node.module or "").split("."))])
            else:
                module = node.module or ""
            for alias in node.names:
                name = alias.name
                private = name.startswith("_") and not name.startswith("__")
                if private and not _is_module(module, name):
                    found.append(f"{path.relative_to(PACKAGE.parents[1])}: {module}.{name}")
    assert found == []


def test_users_get_an_orchestrator_from_its_factory():
    with pytest.raises(TypeError, match=r"omni_trio\.Orchestrator has no public constructor"):
        omni_trio.Orchestrator(None, [], max_in_flight=None, shutdown_grace=1.0)


@pytest.mark.parametrize(
    ("cls", "path"),
    [
        (omni_trio.RequestStream, "omni_trio.RequestStream"),
        (omni_trio.Pipeline, "omni_trio.Pipeline"),
        (
            __import__("omni_trio.compare", fromlist=["x"]).AsyncioRequestStream,
            "omni_trio.compare.AsyncioRequestStream",
        ),
    ],
)
def test_users_get_streams_and_pipelines_from_their_factories(cls, path):
    with pytest.raises(TypeError, match=re.escape(f"{path} has no public constructor")):
        cls("r")


@pytest.mark.parametrize(
    "cls",
    [
        omni_trio.Orchestrator,
        omni_trio.RequestStream,
        omni_trio.Pipeline,
        omni_trio.PipelineStatistics,
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
        Pipeline,
        PipelineStatistics,
        RequestMetrics,
        RequestStream,
        Stage,
        StageItem,
        StageOutput,
        open_orchestrator,
        open_pipeline,
    )
    from omni_trio.compare import AsyncioOrchestrator, open_asyncio_orchestrator  # noqa: F401
    from omni_trio.config import (  # noqa: F401
        ConfigError,
        PipelineConfig,
        load_pipeline,
        parse_pipeline,
        resolve_pipeline,
        shipped_pipeline,
    )
    from omni_trio.demo.runner import DemoOptions, run_demo  # noqa: F401
    from omni_trio.process import (  # noqa: F401
        ChunkIO,
        Engine,
        EngineRequest,
        Last,
        ProcessStage,
        WorkerStartError,
        open_inprocess_stage,
        open_process_pipeline,
        open_process_stage,
        open_ray_stage,
        open_shm_connector,
        testing,
    )

    # moved in issue 40: the old path still works for one version, with a warning
    # (tests/test_public_surface.py checks the warning's text)
    with pytest.warns(OmniTrioDeprecationWarning):
        from omni_trio.process import LocalRayCluster, local_ray_cluster
    assert testing.local_ray_cluster is local_ray_cluster
    assert testing.LocalRayCluster is LocalRayCluster
    assert testing.MemoryNetwork
    from omni_trio.process.worker import main  # noqa: F401
    from omni_trio.testing import ScriptedStage, collect_outputs  # noqa: F401
