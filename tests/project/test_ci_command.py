"""The README's test command is what CI runs (`.ci/run`, verbatim), and it runs the two tiers, the fast
one first: `-m "not slow"`, then `-m slow`, with the same other options, so every test runs exactly once
and a failing fast tier stops CI before the slow one starts. An empty tier passes (tests/conftest.py).
The test modules live one folder per floor, with names unique across folders (pytest's prepend mode)."""
from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def readme_test_command(readme: str) -> str:
    """The command under the README's `# 2. set up and run the tests`."""
    lines = readme.splitlines()
    return lines[lines.index("# 2. set up and run the tests") + 1]


def pytest_runs(command: str) -> list[list[str]]:
    """The arguments after `-m pytest` of each pytest run in a `&&` chain."""
    runs = []
    for part in command.split(" && "):
        words = shlex.split(part)
        if words[1:3] == ["-m", "pytest"]:
            runs.append(words[3:])
    return runs


def tier_problems(command: str) -> list[str]:
    runs = pytest_runs(command)
    if len(runs) != 2:
        return [f"{len(runs)} pytest runs, not two (the fast tier, then the slow one)"]
    marks = []
    for args in runs:
        picked = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-m"]
        marks.append(picked)
    problems = []
    if marks != [["not slow"], ["slow"]]:
        problems.append(f"the runs' -m are {marks}, not [['not slow'], ['slow']] in that order")
    rest = [[a for i, a in enumerate(args) if a != "-m" and (i == 0 or args[i - 1] != "-m")] for args in runs]
    if rest[0] != rest[1]:
        problems.append(f"the two tiers run with different options: {rest[0]} and {rest[1]}")
    if any(a.startswith("tests/") or a.startswith("-k") for args in rest for a in args):
        problems.append("a tier is narrowed to some files or names: every test must run in one of them")
    return problems


def test_ci_runs_the_readmes_test_command_verbatim():
    command = readme_test_command((ROOT / "README.md").read_text())
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_readmes_test_command_runs_the_fast_tier_then_the_slow_one():
    command = readme_test_command((ROOT / "README.md").read_text())
    assert tier_problems(command) == []
    assert any("pytest.mark.slow" in p.read_text() for p in TESTS.rglob("test_*.py"))  # the slow tier has tests


def test_the_tier_check_reports_what_it_guards_against():
    setup = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]'"
    assert tier_problems(f"{setup} && .venv/bin/python -m pytest -q -n 2") == [
        "1 pytest runs, not two (the fast tier, then the slow one)"]
    assert tier_problems(f'{setup} && .venv/bin/python -m pytest -q -n 2 -m slow && '
                         f'.venv/bin/python -m pytest -q -n 2 -m "not slow"') == [
        "the runs' -m are [['slow'], ['not slow']], not [['not slow'], ['slow']] in that order"]
    assert tier_problems(f'{setup} && .venv/bin/python -m pytest -q -n 2 -m "not slow" && '
                         f'.venv/bin/python -m pytest -q -m slow') == [
        "the two tiers run with different options: ['-q', '-n', '2'] and ['-q']"]
    assert tier_problems(f'{setup} && .venv/bin/python -m pytest -q -m "not slow" tests/ir && '
                         f'.venv/bin/python -m pytest -q -m slow tests/ir') == [
        "a tier is narrowed to some files or names: every test must run in one of them"]
    assert tier_problems(f'{setup} && .venv/bin/python -m pytest -q -n 2 -m "not slow" && '
                         f'.venv/bin/python -m pytest -q -n 2 -m slow') == []


def test_an_empty_tier_passes_and_other_empty_runs_do_not(tmp_path):
    """tests/conftest.py's pytest_sessionfinish, alone in a conftest beside one test that is not slow:
    `-m slow` selects nothing and passes; `-k` selecting nothing is still pytest's exit 5."""
    source = (TESTS / "conftest.py").read_text()
    hook = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef) and n.name == "pytest_sessionfinish")
    (tmp_path / "conftest.py").write_text("import pytest\n\n\n" + ast.get_source_segment(source, hook) + "\n")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")

    def run(*args: str) -> int:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               "-o", "addopts=", *args], cwd=tmp_path, capture_output=True, timeout=120).returncode

    assert run("-m", "slow") == 0
    assert run("-k", "no_such_test") == 5


def test_test_modules_live_in_a_floors_folder_with_unique_names():
    """pytest's prepend import mode imports a test module by its file name: two of one name in two
    folders would clash. New tests go in their floor's folder, never flat in tests/."""
    modules = sorted(TESTS.rglob("test_*.py"))
    flat = [p.name for p in modules if p.parent == TESTS]
    assert flat == [], f"test modules directly in tests/ (move each into its floor's folder): {flat}"
    names = [p.name for p in modules if "fixtures" not in p.parts]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    assert not list(TESTS.rglob("__init__.py"))  # prepend mode, no packages: `from support import ...` works
