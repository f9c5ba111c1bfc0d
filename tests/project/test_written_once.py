"""Two things written once (issue 34): the header check of a versioned JSON document (`ir.versioned.check_header`)
and the use-def index of a graph's nodes (`ir.graph`: `Graph.producers()`/`consumers()`, `use_def(nodes)`).
No other module compares a document's `format` by hand or builds an index of who writes or reads each
value of IR nodes. Read from the source with `ast`; the self-test shows each finder reports its fault."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ir", "planner", "runtime", "tasks", "jobs", "confidant")
HEADER_OWNER = "ir/versioned.py"
USE_DEF_OWNER = "ir/graph.py"
# which kind of file a chat_template.json is (ours, or not: then the tokenizer's own specials), a probe
# that refuses nothing, not a check of a document this build reads
FORMAT_PROBES = {"jobs/common/hf_tokenizer.py"}


def _is_format_lookup(node: ast.AST) -> bool:
    """`x.get("format")` or `x["format"]`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "format"
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "format"


def hand_header_checks(source: str) -> list[int]:
    """Lines comparing a document's format by hand."""
    return sorted(n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Compare)
                  and any(_is_format_lookup(side) for side in [n.left, *n.comparators]))


def _over(target: ast.AST, iterable: ast.AST, attr: str) -> tuple[str, str] | None:
    """(loop variable, node variable) when the loop is `for v in node.<attr>`."""
    if isinstance(target, ast.Name) and isinstance(iterable, ast.Attribute) and iterable.attr == attr \
            and isinstance(iterable.value, ast.Name):
        return target.id, iterable.value.id
    return None


def _loop_names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def hand_use_def_indexes(source: str) -> list[int]:
    """Lines building, over many nodes, a producer index (`{o: n for n in nodes for o in n.outputs}`)
    or a reader index (`for n in nodes: for i in n.inputs: index.setdefault(i, ...)`). Keeping a
    pass's own copy up to date as it rewrites one node is no new index."""
    lines = []

    def walk(node: ast.AST, node_loops: set[str]) -> None:
        if isinstance(node, ast.DictComp) and isinstance(node.key, ast.Name):
            bound: set[str] = set()
            for g in node.generators:
                over = _over(g.target, g.iter, "outputs")
                if over and over[0] == node.key.id and over[1] in bound:
                    lines.append(node.lineno)
                bound |= _loop_names(g.target)
        if isinstance(node, ast.For):
            over = _over(node.target, node.iter, "inputs")
            if over and over[1] in node_loops and any(
                    isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "setdefault"
                    and c.args and isinstance(c.args[0], ast.Name) and c.args[0].id == over[0]
                    for c in ast.walk(node)):
                lines.append(node.lineno)
            node_loops = node_loops | _loop_names(node.target)
        for child in ast.iter_child_nodes(node):
            walk(child, node_loops)

    walk(ast.parse(source), set())
    return sorted(lines)


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_only_ir_versioned_checks_a_documents_header():
    found = {f: lines for f, src in _sources() if f != HEADER_OWNER and f not in FORMAT_PROBES
             and (lines := hand_header_checks(src))}
    assert found == {}, f"use ir.versioned.check_header instead of comparing `format` by hand: {found}"


def test_only_ir_graph_builds_a_use_def_index():
    found = {f: lines for f, src in _sources() if f != USE_DEF_OWNER and (lines := hand_use_def_indexes(src))}
    assert found == {}, f"use Graph.producers()/consumers() or ir.graph.use_def(nodes): {found}"


def test_the_finders_report_what_they_guard_against():
    assert hand_header_checks('if doc.get("format") != KEY_FORMAT:\n    raise ValueError\n') == [1]
    assert hand_header_checks('ok = "x" == d["format"]\nname = doc.get("format")\n') == [1]
    assert hand_header_checks('check_header(doc, format="f", versions=None, where="it")\n') == []
    source = ("prod = {o: n.name for n in graph.nodes for o in n.outputs}\n"
              "readers = {}\n"
              "for n in graph.nodes:\n"
              "    for i in n.inputs:\n"
              "        readers.setdefault(i, set()).add(n.name)\n"
              "renamed = {o: o + '@b' for o in node.outputs}\n"  # one node's outputs: no index
              "used = {i for n in nodes for i in n.inputs}\n"
              "for i in new.inputs:\n"  # a pass keeping its copy up to date for one rewritten node
              "    readers.setdefault(i, set()).add(new.name)\n")
    assert hand_use_def_indexes(source) == [1, 4]
    assert hand_use_def_indexes("prod = {o: n for o, n in graph.producers().items()}\n") == []
