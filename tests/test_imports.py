"""Import hygiene: no telemetry-installing MNN.tools, and the dependency direction of DESIGN.md."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ir", "planner", "runtime", "confidant")
STDLIB = set(sys.stdlib_module_names)
# Each third-party library is imported in exactly one module, so it can be swapped in one place.
OWNER = {
    "MNN": {"runtime/engines/mnn_kernels.py"}, "_mnncengine": {"runtime/engines/mnn_kernels.py"},
    "onnx": {"planner/onnx_import.py"}, "networkx": {"planner/passes.py"},
    "torch": {"runtime/engines/pytorch.py", "confidant/export.py"},
    "transformers": {"confidant/export.py"}, "tokenizers": {"tasks/tokenize.py"},
    "zmq": {"runtime/transport/zeromq.py"}, "ortools": {"planner/partition.py"}, "yaml": {"planner/cluster.py"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _all_modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).glob("*.py")):
            yield path.relative_to(ROOT).as_posix(), _imports(path)


def test_ir_imports_only_stdlib_and_numpy():
    for rel, names in _all_modules():
        if rel.startswith("ir/"):
            bad = {n for n in names if n.split(".")[0] not in STDLIB | {"numpy", "ir"}}
            assert not bad, f"{rel} imports {bad}"


def test_runtime_never_imports_planner():
    for rel, names in _all_modules():
        if rel.startswith("runtime/"):
            assert not {n for n in names if n.split(".")[0] in ("planner", "confidant")}, rel


def test_each_third_party_library_has_one_owner():
    for rel, names in _all_modules():
        for name in names:
            owners = OWNER.get(name.split(".")[0])
            if owners is not None:
                assert rel in owners, f"{rel} imports {name}; only {sorted(owners)} may"


def test_no_module_imports_mnn_tools():
    for rel, names in _all_modules():
        assert not {n for n in names if n.startswith("MNN.tools")}, rel


def test_importing_the_project_loads_neither_mnn_tools_nor_aliyun():
    code = (
        "import sys, importlib\n"
        "for m in ['confidant.cli', 'confidant.commands', 'ir.graph', 'planner.onnx_import', 'planner.passes',\n"
        "          'runtime.engines.mnn', 'tasks.trainer', 'tasks.tokenize']:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.startswith('MNN.tools') or 'aliyun' in m)\n"
        "print('BAD', bad)\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BAD []" in proc.stdout


def test_the_guard_itself_can_fail():
    """The subprocess check above would notice MNN.tools: importing it (without running its
    telemetry install) shows up in sys.modules under that name."""
    names = {"MNN.tools.mnnconvert"}
    assert sorted(m for m in names if m.startswith("MNN.tools") or "aliyun" in m) == ["MNN.tools.mnnconvert"]
