"""The project's layering, read from its imports (``scripts/import_graph.py``): the layers
folder imports no other project folder, the pipeline runtime only the layers, no schedule
package another, and no modules import each other in a cycle."""
import sys

from harness import REPO

sys.path.insert(0, REPO)
from scripts import import_graph  # noqa: E402


def test_folders_import_only_what_their_layer_allows():
    edges = import_graph.folder_edges(import_graph.import_graph())
    assert import_graph.layer_violations(edges) == []
    assert not any(source == "megatron/plugin/layers" for source, _ in edges)
    assert {target for source, target in edges if source == "megatron/plugin/pipeline"} == \
        {"megatron/plugin/layers"}
    schedules = set(import_graph.SCHEDULES)
    assert not [edge for edge in edges if edge[0] in schedules and edge[1] in schedules]


def test_no_module_imports_itself_through_others():
    assert import_graph.cycles(import_graph.import_graph()) == []


def test_the_checks_see_what_they_forbid(tmp_path):
    """A planted upward import and a planted cycle are found."""
    for package in import_graph.PACKAGES:
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
    layers = tmp_path / "megatron/plugin/layers"
    layers.mkdir(parents=True)
    (layers / "a.py").write_text("from megatron.plugin.layers import b\n")
    (layers / "b.py").write_text("def f():\n    from megatron.plugin.layers.a import g\n")
    (layers / "c.py").write_text("import megatron.plugin.registry\n")
    (tmp_path / "megatron/plugin/registry.py").write_text("")
    graph = import_graph.import_graph(tmp_path)
    assert import_graph.cycles(graph) == [["megatron.plugin.layers.a", "megatron.plugin.layers.b"]]
    edges = import_graph.folder_edges(graph, tmp_path)
    assert import_graph.layer_violations(edges) == ["megatron/plugin/layers -> megatron/plugin"]
