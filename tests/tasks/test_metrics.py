"""Entity-level scoring against hand-computed conlleval results."""

import pytest

from tasks.ner.conll import to_iob2
from tasks.ner.datagen import generate
from tasks.metrics import entity_f1, extract_entities


@pytest.mark.parametrize(
    "tags, expected",
    [
        (["B-PER", "I-PER", "O", "B-LOC"], {("PER", 0, 2), ("LOC", 3, 4)}),
        (["O", "O"], set()),
        ([], set()),
        # Entity running to the end of the sentence.
        (["O", "B-ORG", "I-ORG"], {("ORG", 1, 3)}),
        # Adjacent same-type entities need B- to separate them.
        (["B-LOC", "B-LOC", "I-LOC"], {("LOC", 0, 1), ("LOC", 1, 3)}),
        # IOB1: I- starts an entity; B- only splits adjacent same-type ones.
        (["I-PER", "I-PER", "B-PER", "O"], {("PER", 0, 2), ("PER", 2, 3)}),
        (["I-ORG", "O", "I-MISC"], {("ORG", 0, 1), ("MISC", 2, 3)}),
        # conlleval: a stray I- after O, or after another type, starts a new entity.
        (["O", "I-PER", "I-PER"], {("PER", 1, 3)}),
        (["B-PER", "I-ORG", "I-ORG"], {("PER", 0, 1), ("ORG", 1, 3)}),
        (["B-PER", "I-PER", "I-LOC", "I-PER"], {("PER", 0, 2), ("LOC", 2, 3), ("PER", 3, 4)}),
        # B- after I- of the same type still starts a new entity.
        (["B-PER", "I-PER", "B-PER"], {("PER", 0, 2), ("PER", 2, 3)}),
    ],
)
def test_extract_entities(tags, expected):
    assert extract_entities(tags) == expected


def test_extract_entities_rejects_bad_tag():
    with pytest.raises(ValueError, match=r"position 2: invalid NER tag 'E-PER'"):
        extract_entities(["O", "B-PER", "E-PER"])


def test_hand_computed_scores():
    gold = [
        ["B-PER", "I-PER", "O", "B-LOC"],  # PER(0,2) LOC(3,4)
        ["B-ORG", "I-ORG", "I-ORG", "O", "B-MISC"],  # ORG(0,3) MISC(4,5)
    ]
    pred = [
        ["B-PER", "I-PER", "O", "B-ORG"],  # PER correct; ORG(3,4) wrong type
        ["B-ORG", "I-ORG", "O", "O", "B-MISC"],  # ORG(0,2) wrong end; MISC correct
    ]
    s = entity_f1(gold, pred)
    assert (s.n_gold, s.n_pred, s.n_correct) == (4, 4, 2)
    assert s.precision == pytest.approx(0.5)
    assert s.recall == pytest.approx(0.5)
    assert s.f1 == pytest.approx(0.5)
    assert set(s.per_type) == {"PER", "LOC", "ORG", "MISC"}
    assert s.per_type["PER"].f1 == 1.0
    loc = s.per_type["LOC"]
    assert (loc.n_gold, loc.n_pred, loc.n_correct, loc.precision, loc.recall, loc.f1) == (
        1, 0, 0, 0.0, 0.0, 0.0,
    )
    org = s.per_type["ORG"]
    assert (org.n_gold, org.n_pred, org.n_correct) == (1, 2, 0)
    assert s.per_type["MISC"].precision == 1.0


def test_unequal_precision_and_recall():
    gold = [["B-PER", "O", "B-PER", "O", "B-LOC", "O"]]
    pred = [["B-PER", "O", "O", "O", "B-LOC", "I-LOC"]]
    s = entity_f1(gold, pred)
    # correct: PER(0,1); LOC(4,6) has the wrong end.  p = 1/2, r = 1/3.
    assert (s.n_gold, s.n_pred, s.n_correct) == (3, 2, 1)
    assert s.precision == pytest.approx(1 / 2)
    assert s.recall == pytest.approx(1 / 3)
    assert s.f1 == pytest.approx(2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3))


def test_stray_i_tags_score_like_conlleval():
    # A prediction that opens an entity with I- still matches a B- gold entity.
    gold = [["O", "B-PER", "I-PER", "O"], ["B-LOC", "O"]]
    pred = [["O", "I-PER", "I-PER", "O"], ["I-LOC", "O"]]
    assert entity_f1(gold, pred).f1 == 1.0
    # I- of another type splits the entity: both halves are wrong.
    s = entity_f1([["B-PER", "I-PER"]], [["B-PER", "I-ORG"]])
    assert (s.n_gold, s.n_pred, s.n_correct) == (1, 2, 0)


def test_iob1_gold_against_iob2_prediction():
    iob1 = [["I-ORG", "O", "I-MISC", "O", "I-LOC", "B-LOC", "I-LOC"]]
    iob2 = [list(to_iob2(iob1[0]))]
    assert iob2 == [["B-ORG", "O", "B-MISC", "O", "B-LOC", "B-LOC", "I-LOC"]]
    s = entity_f1(iob1, iob2)
    assert (s.n_gold, s.n_correct, s.f1) == (4, 4, 1.0)


def test_perfect_and_all_o_predictions_on_generated_data():
    gold = [list(s.tags) for s in generate(200, seed=11)]
    perfect = entity_f1(gold, gold)
    assert perfect.f1 == 1.0 and perfect.n_gold > 200
    nothing = entity_f1(gold, [["O"] * len(g) for g in gold])
    assert (nothing.precision, nothing.recall, nothing.f1, nothing.n_pred) == (0.0, 0.0, 0.0, 0)


def test_zero_division_gives_zero():
    s = entity_f1([["O", "O"]], [["O", "O"]])
    assert (s.precision, s.recall, s.f1, s.n_gold, s.n_pred, s.n_correct) == (0.0, 0.0, 0.0, 0, 0, 0)
    assert s.per_type == {}
    s = entity_f1([["O"]], [["B-PER"]])
    assert (s.precision, s.recall, s.f1) == (0.0, 0.0, 0.0)
    assert entity_f1([], []).f1 == 0.0


def test_sentence_length_mismatch_names_index():
    with pytest.raises(ValueError) as err:
        entity_f1([["O"], ["B-PER", "I-PER", "O"]], [["O"], ["B-PER", "I-PER"]])
    assert str(err.value) == "sentence 1: gold has 3 tags but pred has 2"


def test_sentence_count_mismatch():
    with pytest.raises(ValueError, match="gold has 2 sentences but pred has 1"):
        entity_f1([["O"], ["O"]], [["O"]])


def test_bad_tag_names_sentence():
    with pytest.raises(ValueError, match=r"sentence 1: position 0: invalid NER tag 'PER'"):
        entity_f1([["O"], ["PER"]], [["O"], ["O"]])


def test_a_type_only_predicted_gets_its_own_scores():
    # MISC appears only in the predictions: it must be scored (precision 0, nothing recalled), not
    # dropped, and its false positive must weigh on the micro-averaged precision.
    gold = [["B-PER", "I-PER", "O", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-MISC"]]
    s = entity_f1(gold, pred)
    assert set(s.per_type) == {"PER", "MISC"}
    misc = s.per_type["MISC"]
    assert (misc.n_gold, misc.n_pred, misc.n_correct) == (0, 1, 0)
    assert (misc.precision, misc.recall, misc.f1) == (0.0, 0.0, 0.0)
    assert (s.n_gold, s.n_pred, s.n_correct) == (1, 2, 1)
    assert (s.precision, s.recall) == (0.5, 1.0)
    # The totals are the sums over the per-type entries: nothing is counted outside them.
    assert s.n_pred == sum(t.n_pred for t in s.per_type.values())
    assert s.n_gold == sum(t.n_gold for t in s.per_type.values())
    assert s.n_correct == sum(t.n_correct for t in s.per_type.values())
