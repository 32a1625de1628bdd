"""scripts/papers/: each paper's data file read, every claim naming a measure and a term its
module has, a malformed claim refused by name, and a claim added as one line of data priced at
its own setting."""
import sys

import pytest

from harness import REPO
for folder in (REPO, f"{REPO}/scripts"):  # the papers' modules import paper_terms by name
    if folder not in sys.path:
        sys.path.insert(0, folder)

from papers import claims, helixpipe, infinipipe, sppo  # noqa: E402

from longctx.chunks import Chunk, Piece  # noqa: E402
from longctx.cost_model import CostModel, ParallelConfig  # noqa: E402

MODULES = (infinipipe, helixpipe, sppo)


def test_every_claim_names_a_measure_and_a_term_of_its_module():
    for module in MODULES:
        paper = module.PAPER
        assert set(paper.sections) == set(module.SECTIONS) == set(module.MEASURES)
        for section, found in ((s, c) for s, cs in paper.sections.items() for c in cs):
            assert found.measure in module.MEASURES[section], found.what
            assert found.why is None or found.why in module.WHYS, found.what
            assert set(found.testbeds) <= set(paper.testbeds)
            assert (found.published is None) == (found.bound is not None), found.what
            assert found.source.startswith("L") and found.kind in claims.KINDS


def test_the_claims_count_and_a_product_is_the_papers_two_numbers():
    """103 rows (InfiniPipe 35 + 18, HelixPipe 16 + 13, SPPO 21); Table 3's all-to-all seconds
    are its end-to-end seconds times its share, as the paper's two numbers multiply."""
    counts = {name: len(found) for module in MODULES
              for name, found in module.PAPER.sections.items()}
    assert counts == {"infinipipe": 35, "table3": 18, "helixpipe": 16, "helix_figures": 13,
                      "sppo": 21}
    seconds = [c for c in infinipipe.PAPER.sections["table3"] if c.measure == "a2a_seconds"]
    assert seconds[0].published == 1.128 * 0.074


@pytest.mark.parametrize("change, message", [
    ({"at_least": 1.0}, "exactly one of"), ({"value": None}, "exactly one of"),
    ({"kind": "speed"}, "kind 'speed'"), ({"valeu": 1.0}, "unknown: \\['valeu'\\]"),
    ({"source": None}, "needs \\['source'\\]")])
def test_a_malformed_claim_is_refused_by_its_row(change, message):
    entry = {"measure": "a2a_seconds", "kind": "seconds", "value": 1.0, "source": "L1",
             "what": "a row"}
    entry.update(change)
    entry = {key: value for key, value in entry.items() if value is not None}
    with pytest.raises(ValueError, match=message) as error:
        claims.claim("P", "s", "t", entry)
    assert "P s: 'a row'" in str(error.value)


def test_a_claim_naming_what_its_module_lacks_is_refused_before_pricing():
    found = claims.claim("P", "s", "t", {"measure": "a2a_second", "kind": "seconds",
                                         "value": 1.0, "source": "L1", "what": "a row"})
    with pytest.raises(ValueError, match="measure 'a2a_second'"):
        claims.judged((found,), infinipipe.MEASURES["table3"], None)
    why = claims.claim("P", "s", "t", {"measure": "speedup", "kind": "ratio", "value": 1.0,
                                       "source": "L1", "what": "a row", "why": "zero"})
    with pytest.raises(ValueError, match="why 'zero'"):
        claims.judged((why,), infinipipe.MEASURES["infinipipe"], None, infinipipe.WHYS)


HEAD = """paper = "InfiniPipe"
text = "infinipipe_elastic_pipeline_parallelism.txt"
testbed = "infinipipe-a800"

[testbeds.infinipipe-a800]
profile = "a800"
overrides = { node_nic_gbps = 50.0 }
source = "L341"

[claims]
"""


def test_a_claim_added_as_a_line_is_priced_at_its_setting(tmp_path):
    """Two lines of Table 3 data, SP 16 and SP 8 at 64K (a context the paper's table does not
    have): each row's number is the all-to-all of that degree at that length, over the
    product of the line's two numbers (0.8 s, far from both); the one inside a node (SP 8)
    carries NCCL's NVLink rate as its why, the other none (open)."""
    (tmp_path / "infinipipe.toml").write_text(HEAD + "table3 = [\n" + "".join(
        f'  {{ measure = "a2a_seconds", kind = "seconds", product = [2.0, 0.4], source = "L1", '
        f'setting = {{ sp = {sp}, context = 65536 }}, what = "SP {sp} at 64K" }},\n'
        for sp in (16, 8)) + "]\n")
    paper = claims.load("infinipipe", tmp_path)
    pricing = infinipipe.table3_pricing()
    wide, inside = claims.judged(paper.sections["table3"], infinipipe.MEASURES["table3"],
                                 pricing)
    chunk = Chunk((Piece(0, 0, 0, 65536, True),))
    for found, sp in ((wide, 16), (inside, 8)):
        cost = CostModel(pricing.model, pricing.profile, ParallelConfig(pp=1, sp=sp))
        expected = 2 * cost.layer_collectives(chunk) * pricing.model.num_layers
        assert found["simulated"] == expected and found["published"] == 2.0 * 0.4
        assert found["simulated_over_published"] == expected / 0.8
    assert wide["simulated"] != inside["simulated"]
    # both far from 0.8 s: SP 8's all-to-all stays inside the node, SP 16's crosses the NICs
    assert inside["why"]["name"].startswith("NVLink at the rate NCCL reaches")
    at_nccl = CostModel(pricing.model, pricing.nccl, ParallelConfig(pp=1, sp=8))
    assert inside["why"]["simulated_with"] == \
        2 * at_nccl.layer_collectives(chunk) * pricing.model.num_layers
    assert wide["why"] is None and wide["verdict"] == "open"


def test_a_claim_naming_a_testbed_the_file_lacks_is_refused(tmp_path):
    (tmp_path / "p.toml").write_text(HEAD + 'table3 = [\n  { measure = "a2a_seconds", kind = '
                                     '"seconds", value = 1.0, source = "L1", testbeds = '
                                     '["h100"], what = "a row" },\n]\n')
    with pytest.raises(ValueError, match="names testbeds \\['h100'\\]"):
        claims.load("p", tmp_path)
