"""A graph's use-def view: who writes and who reads each value, built once per graph and read-only."""
import pickle

import pytest

from ir.graph import Graph, Node, Value, use_def


def _graph() -> Graph:
    nodes = (Node("a", "Relu", ("x",), ("y",)), Node("b", "Add", ("y", "y"), ("z",)), Node("c", "Neg", ("y",), ("w",)))
    values = {n: Value(n, (2,), "float32") for n in "xyzw"}
    return Graph("g", (values["x"],), (values["z"], values["w"]), nodes, values, {}, ())


def test_producers_and_readers_in_graph_order():
    g = _graph()
    assert {k: n.name for k, n in g.producers().items()} == {"y": "a", "z": "b", "w": "c"}
    assert {k: [n.name for n in ns] for k, ns in g.consumers().items()} == {"x": ["a"], "y": ["b", "b", "c"]}
    part = use_def(g.nodes[1:])
    assert set(part.producers) == {"z", "w"} and [n.name for n in part.readers["y"]] == ["b", "b", "c"]


def test_the_view_is_built_once_cannot_be_changed_and_the_graph_still_pickles():
    g = _graph()
    assert g.producers()["y"] is g.producers()["y"] and g._use_def() is g._use_def()
    with pytest.raises(TypeError):
        g.producers()["q"] = g.nodes[0]  # type: ignore[index]
    with pytest.raises(TypeError):
        g.consumers()["y"] = ()  # type: ignore[index]
    back = pickle.loads(pickle.dumps(g))
    assert [n.name for n in back.consumers()["y"]] == ["b", "b", "c"]
