"""The import graph of DESIGN.md: no circles, the dependency direction, one owner per library, no MNN.tools,
jobs/common the floor below the jobs (and every other module of jobs/ run by a command), no private
name of another module used by a job.

The graph is read from the source with `ast`, nothing is imported: a node per module of the project's
packages (subpackages included, `pkg/__init__.py` is the module `pkg`), an edge per import anywhere in
the module, lazy ones inside functions too. `from pkg import mod` is an edge to the module `pkg.mod`
when that is a project module; `from pkg.mod import name` is an edge to `pkg.mod`. Imports under
`if TYPE_CHECKING:` are left out, since they never run (they are how a type-only circle is broken).
Each check is a small function of that graph, so the self-tests at the bottom can show on a fake graph
that every one of them reports what it guards against.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ir", "planner", "runtime", "tasks", "jobs", "confidant")
STDLIB = frozenset(sys.stdlib_module_names)

Graph = Mapping[str, "set[str]"]  # module -> the dotted names it imports


# --- reading the graph ------------------------------------------------------------------------

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files() -> dict[str, Path]:
    """Every module of the project's packages, subpackages included, by dotted name."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `node`, at any depth, except in `if TYPE_CHECKING:` bodies."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    for child in node.orelse if _is_type_checking(node) else ast.iter_child_nodes(node):
        yield from _import_nodes(child)


def imports_of(source: str, module: str, modules: Iterable[str], is_package: bool = False) -> set[str]:
    """The dotted names `module` imports. `from a import b` gives `a.b` when that is a project module
    (a submodule), or when `a` is third-party (so `from MNN import tools` reads as `MNN.tools`)."""
    modules = set(modules)
    names: set[str] = set()
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: resolved against this module's package
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            third_party = base.split(".")[0] not in PACKAGES
            names.add(sub if sub in modules or (third_party and alias.name != "*") else base)
    return names


def project_graph() -> dict[str, set[str]]:
    files = project_files()
    return {m: imports_of(p.read_text(), m, files, p.name == "__init__.py") for m, p in files.items()}


def _first_existing(*candidates: str) -> str:
    """The first of `candidates` that is a module today (for owners that are about to move)."""
    files = project_files()
    return next((c for c in candidates if c in files), candidates[-1])


# --- the rules ----------------------------------------------------------------------------------

# What each package may not import (by top-level name), and for `ir` the only things it may import.
FORBIDDEN = {
    "jobs": {"confidant"},
    "runtime": {"planner", "tasks", "jobs", "confidant"},
    "tasks": {"planner", "jobs", "confidant"},
    "planner": {"runtime", "tasks", "jobs", "confidant"},
}
ONLY = {"ir": STDLIB | {"numpy", "ir"}}

# Each third-party library is imported in its owner modules and nowhere else in the project, so it can
# be swapped or mocked in one place; an empty tuple: no project module at all (tests only).
EXPORTER = _first_existing("jobs.export.encoder", "confidant.export")
OWNERS: dict[str, tuple[str, ...]] = {
    "MNN": ("runtime.engines.mnn_kernels",),
    "_mnncengine": ("runtime.engines.mnn_kernels",),
    # onnx_quantize: export --base-dtype's files; and the ONNX exporter, should it ever import onnx itself
    "onnx": ("planner.onnx_import", "planner.onnx_quantize"),
    "networkx": ("planner.passes",),
    "torch": ("runtime.engines.pytorch", EXPORTER, "jobs.export.llm"),
    "transformers": (EXPORTER, "jobs.export.llm", "jobs.common.hf_tokenizer"),  # hf_tokenizer: the tokenizer of what we write
    "tokenizers": ("tasks.tokenize",),
    "zmq": ("runtime.transport.zeromq",),
    "nacl": ("runtime.keys",),
    "ortools": (_first_existing("planner.partition.cpsat", "planner.partition"),),
    "yaml": ("planner.cluster",),
    "safetensors": (),  # the project has its own codec, ir.safetensors; the package is the tests' reference
    "onnxruntime": ("tasks.causal_lm.generate",),  # generation on the exported file; and the tests' forward oracle
}
# Third-party libraries any module may import.
FREE = {"numpy"}


def _top(name: str) -> str:
    return name.split(".")[0]


def _path_back(graph: Graph, start: str) -> list[str] | None:
    """The shortest chain of imports from `start` back to itself (breadth first), or None."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        for nxt in sorted(n for n in graph[here] if n in graph):
            if nxt == start:
                path = [here]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return path[::-1]
            if nxt not in previous:
                previous[nxt] = here
                queue.append(nxt)
    return None


def circles(graph: Graph) -> list[list[str]]:
    """Each import circle among the graph's modules, once: the shortest one through each module,
    rotated to start at its smallest name and closed (`[a, b, a]`)."""
    found = set()
    for start in graph:
        path = _path_back(graph, start)
        if path:
            i = path.index(min(path))
            found.add(tuple(path[i:] + path[:i]))
    return [[*c, c[0]] for c in sorted(found)]


def forbidden_edges(graph: Graph) -> list[str]:
    problems = []
    for module, names in sorted(graph.items()):
        pkg = _top(module)
        for name in sorted(names):
            if _top(name) in FORBIDDEN.get(pkg, ()) or (pkg in ONLY and _top(name) not in ONLY[pkg]):
                problems.append(f"{module} imports {name}")
    return problems


# jobs/ (DESIGN.md's module map): jobs/common holds what the jobs share and is the floor below them;
# every other module of jobs/ is a job, or a part of a job group's folder (jobs/train/pipeline_run.py).
JOBS_COMMON = "jobs.common"
UPPER_FLOORS = ("jobs", "confidant")  # whose modules may not import another module's private names


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def job_floor_problems(graph: Graph) -> list[str]:
    """jobs.common importing a job; a module of jobs/ (not jobs.common, not a package) that neither
    the command line (confidant) nor a module of its own folder imports: no command runs it, so it is
    no job, and what jobs share belongs in jobs.common."""
    packages = {m.rsplit(".", 1)[0] for m in graph if "." in m}
    problems = []
    for module, names in sorted(graph.items()):
        if _within(module, JOBS_COMMON):
            problems += [f"{module} imports {n}, a job: jobs.common is the floor below the jobs"
                         for n in sorted(names) if _top(n) == "jobs" and n in graph and n not in packages
                         and not _within(n, JOBS_COMMON)]
    for module in sorted(graph):
        if _top(module) != "jobs" or module in packages or _within(module, JOBS_COMMON):
            continue
        folder = module.rsplit(".", 1)[0]
        users = [u for u, names in graph.items() if module in names and u != module]
        if not any(_top(u) == "confidant" or u.rsplit(".", 1)[0] == folder for u in users):
            problems.append(f"{module} is run by no command (confidant imports it not, nor does its folder)")
    return problems


def private_name_imports(sources: Mapping[str, str], floors: Iterable[str] = UPPER_FLOORS) -> list[str]:
    """`from pkg.mod import _name` in a module of `floors` from another module: a private name used
    across modules is a shared part with no owner (it belongs public in the module both use)."""
    problems = []
    for module, source in sorted(sources.items()):
        if _top(module) not in floors:
            continue
        for node in _import_nodes(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and _top(node.module or "") in PACKAGES \
                    and node.module != module:
                problems += [f"{module} imports {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    return problems


def misplaced_libraries(graph: Graph, owners: Mapping[str, tuple[str, ...]] = OWNERS) -> list[str]:
    problems = []
    for module, names in sorted(graph.items()):
        for name in sorted(names):
            lib = _top(name)
            if lib in PACKAGES or lib in STDLIB or lib in FREE:
                continue
            if lib not in owners:
                problems.append(f"{module} imports {name}, a library with no owner in OWNERS")
            elif module not in owners[lib]:
                where = ", ".join(owners[lib]) or "no project module (tests only)"
                problems.append(f"{module} imports {name}; only {where} may")
    return problems


def is_telemetry(name: str) -> bool:
    """MNN.tools installs an Aliyun log handler when imported; neither may ever be loaded."""
    return name == "MNN.tools" or name.startswith("MNN.tools.") or "aliyun" in name.lower()


def telemetry_imports(graph: Graph) -> list[str]:
    return [f"{m} imports {n}" for m, names in sorted(graph.items()) for n in sorted(names) if is_telemetry(n)]


def modules_loaded_after(modules: Iterable[str], then: str = "") -> list[str]:
    """`sys.modules` of a fresh interpreter after importing `modules` and running `then`."""
    code = ("import importlib, json, sys\n"
            f"for m in {sorted(modules)!r}:\n"
            "    importlib.import_module(m)\n"
            f"{then}\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# --- the real graph -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return project_graph()


def test_the_walk_finds_subpackages_and_every_owner(graph):
    assert {"runtime.engines.mnn_kernels", "runtime.transport.zeromq", "runtime.pipeline.executor",
            "runtime.profiling.compute", "tasks.metrics", "jobs.train.pipeline", "ir"} <= set(graph)
    stale = sorted({o for owners in OWNERS.values() for o in owners} - set(graph))
    assert not stale, f"OWNERS names modules that do not exist: {stale}"


def test_no_import_circles(graph):
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_dependency_direction(graph):
    problems = forbidden_edges(graph)
    assert not problems, "\n".join(problems)


def test_each_third_party_library_has_its_one_owner(graph):
    problems = misplaced_libraries(graph)
    assert not problems, "\n".join(problems)


def test_jobs_common_is_the_floor_below_the_jobs_and_every_other_job_module_is_run_by_a_command(graph):
    problems = job_floor_problems(graph)
    assert not problems, "\n".join(problems)


def test_no_job_imports_another_modules_private_names():
    problems = private_name_imports({m: p.read_text() for m, p in project_files().items()})
    assert not problems, "\n".join(problems)


def test_no_module_imports_mnn_tools(graph):
    problems = telemetry_imports(graph)
    assert not problems, "\n".join(problems)


def test_importing_the_project_loads_neither_mnn_tools_nor_aliyun(graph):
    loaded = modules_loaded_after(m for m in graph if not m.endswith("__main__"))  # __main__ runs the CLI
    assert {"runtime.engines.mnn_kernels", "_mnncengine", "zmq"} <= set(loaded)  # the real libraries did load
    assert [m for m in loaded if is_telemetry(m)] == []


# --- the checks can fail --------------------------------------------------------------------------

FAKE_SOURCE = '''
from typing import TYPE_CHECKING
import numpy as np
from runtime.transport import zeromq, wire
from runtime.transport.wire import Expected
from MNN import tools
from . import local
if TYPE_CHECKING:
    import planner.cost
else:
    import json

def lazy():
    import torch.nn
'''


def test_the_reader_counts_lazy_and_submodule_imports():
    modules = {"runtime.transport.zeromq", "runtime.transport.wire", "runtime.transport.local"}
    assert imports_of(FAKE_SOURCE, "runtime.transport.fake", modules) == {
        "typing.TYPE_CHECKING", "numpy", "runtime.transport.zeromq", "runtime.transport.wire", "MNN.tools",
        "runtime.transport.local", "json", "torch.nn"}


def test_the_checks_report_a_fake_graphs_faults():
    fake = {
        "ir.a": {"ir.b", "numpy"},
        "ir.b": {"ir.a", "scipy.linalg"},                # a circle, and ir importing a third party
        "runtime.x": {"planner.cost", "ir.a"},           # runtime -> planner
        "tasks.t": {"jobs.train.pipeline"},           # tasks -> jobs
        "planner.p": {"runtime.x", "zmq", "ortools.sat"},  # planner -> runtime; zmq outside its owner
        "runtime.transport.zeromq": {"zmq"},
        "confidant.c": {"safetensors.numpy", "MNN.tools.mnnconvert"},
    }
    assert circles(fake) == [["ir.a", "ir.b", "ir.a"]]
    assert circles({**fake, "ir.b": {"runtime.x"}, "runtime.x": {"tasks.t"}, "tasks.t": {"ir.a"}}) == [
        ["ir.a", "ir.b", "runtime.x", "tasks.t", "ir.a"]]
    assert circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": set()}) == []
    assert forbidden_edges(fake) == ["ir.b imports scipy.linalg", "planner.p imports runtime.x",
                                     "runtime.x imports planner.cost", "tasks.t imports jobs.train.pipeline"]
    assert misplaced_libraries(fake, {**OWNERS, "ortools": ("planner.p",)}) == [
        "confidant.c imports MNN.tools.mnnconvert; only runtime.engines.mnn_kernels may",
        "confidant.c imports safetensors.numpy; only no project module (tests only) may",
        "ir.b imports scipy.linalg, a library with no owner in OWNERS",
        "planner.p imports zmq; only runtime.transport.zeromq may",
    ]
    assert telemetry_imports(fake) == ["confidant.c imports MNN.tools.mnnconvert"]


def test_the_job_floor_checks_report_a_fake_graphs_faults():
    fake = {
        "jobs": set(), "jobs.common": set(), "jobs.train": set(), "confidant.commands": {"jobs.train.local", "jobs.plan"},
        "jobs.common.report": set(), "jobs.common.settings": {"jobs.common.report", "jobs.plan"},  # common -> a job
        "jobs.plan": {"jobs.common.settings"},
        "jobs.train.local": {"jobs.train.part", "jobs.common"},
        "jobs.train.part": set(),      # a part of jobs/train: imported by its folder
        "jobs.orphan": {"jobs.plan"},  # no command runs it
    }
    assert job_floor_problems(fake) == [
        "jobs.common.settings imports jobs.plan, a job: jobs.common is the floor below the jobs",
        "jobs.orphan is run by no command (confidant imports it not, nor does its folder)"]
    assert forbidden_edges({"jobs.plan": {"confidant.progress"}}) == ["jobs.plan imports confidant.progress"]
    sources = {"jobs.a": "from jobs.b import _helper, public, __version__\nfrom . import _x\n",
               "jobs.b": "from jobs.b import _self\n", "planner.p": "from planner.q import _shared\n"}
    assert private_name_imports(sources) == ["jobs.a imports jobs.b._helper"]


def test_the_loaded_module_guard_sees_planted_mnn_tools():
    """The subprocess check above, run on an interpreter where MNN.tools-like modules are loaded
    (planted as empty modules: importing the real one would install its telemetry)."""
    plant = ("import types\n"
             "for m in ['MNN.tools', 'MNN.tools.mnnconvert', 'aliyun.log']:\n"
             "    sys.modules[m] = types.ModuleType(m)\n")
    loaded = modules_loaded_after(["json"], then=plant)
    assert [m for m in loaded if is_telemetry(m)] == ["MNN.tools", "MNN.tools.mnnconvert", "aliyun.log"]


def test_no_test_module_imports_another():
    """Tests share code through conftest.py fixtures and tests/support.py, never by importing
    another test module (or conftest) by name."""
    tests = ROOT / "tests"
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.name} imports {n}" for n in names
                          if n.split(".")[0] == "conftest" or n.split(".")[0].startswith("test_")]
    assert not offenders, offenders
