"""CoNLL-2003 reading and writing, IOB1/IOB2 handling and error reporting."""

from pathlib import Path

import pytest

from tasks.ner.conll import Sentence, read_conll, to_iob2, write_conll
from tasks.ner.datagen import generate

# The opening of the original CoNLL-2003 English training file: IOB1, so
# entities start with I- and B- appears only between adjacent same-type
# entities (added here as "Paris B-LOC" after "France I-LOC").
IOB1_TEXT = """\
-DOCSTART- -X- O O

EU NNP I-NP I-ORG
rejects VBZ I-VP O
German JJ I-NP I-MISC
call NN I-NP O
to TO I-VP O
boycott VB I-VP O
British JJ I-NP I-MISC
lamb NN I-NP O
. . O O

Peter NNP I-NP I-PER
Blackburn NNP I-NP I-PER

From IN I-PP O
France NNP I-NP I-LOC
Paris NNP I-NP B-LOC
"""


def write_text(tmp_path: Path, text: str, name: str = "train.txt") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


def test_round_trip_generated_sentences(tmp_path):
    sentences = generate(300, seed=3)
    path = tmp_path / "out.txt"
    write_conll(path, sentences)
    assert read_conll(path) == sentences


def test_round_trip_keeps_iob1_tags_when_asked(tmp_path):
    sentences = [
        Sentence(("EU", "rejects", "German", "call"), ("I-ORG", "O", "I-MISC", "O")),
        Sentence(("France", "Paris"), ("I-LOC", "B-LOC")),
    ]
    path = tmp_path / "out.txt"
    write_conll(path, sentences)
    assert read_conll(path, iob2=False) == sentences
    assert read_conll(path) == [
        Sentence(("EU", "rejects", "German", "call"), ("B-ORG", "O", "B-MISC", "O")),
        Sentence(("France", "Paris"), ("B-LOC", "B-LOC")),
    ]


def test_written_layout(tmp_path):
    path = tmp_path / "out.txt"
    write_conll(path, [Sentence(("Peter", "Blackburn"), ("B-PER", "I-PER")), Sentence(("Hi",), ("O",))])
    assert path.read_text() == (
        "-DOCSTART- -X- -X- O\n"
        "\n"
        "Peter -X- -X- B-PER\n"
        "Blackburn -X- -X- I-PER\n"
        "\n"
        "Hi -X- -X- O\n"
        "\n"
    )


def test_reads_original_iob1_file(tmp_path):
    path = write_text(tmp_path, IOB1_TEXT)
    raw = read_conll(path, iob2=False)
    assert [s.tokens for s in raw] == [
        ("EU", "rejects", "German", "call", "to", "boycott", "British", "lamb", "."),
        ("Peter", "Blackburn"),
        ("From", "France", "Paris"),
    ]
    assert raw[0].tags == ("I-ORG", "O", "I-MISC", "O", "O", "O", "I-MISC", "O", "O")
    assert raw[2].tags == ("O", "I-LOC", "B-LOC")

    converted = read_conll(path)
    assert converted[0].tags == ("B-ORG", "O", "B-MISC", "O", "O", "O", "B-MISC", "O", "O")
    assert converted[1].tags == ("B-PER", "I-PER")
    assert converted[2].tags == ("O", "B-LOC", "B-LOC")


def test_tolerates_crlf_trailing_space_tabs_and_missing_final_blank(tmp_path):
    text = (
        "\ufeff-DOCSTART- -X- -X- O\r\n\r\n"
        "EU NNP I-NP B-ORG   \r\n"
        "rejects\tVBZ\tI-VP\tO\r\n"
        " \t \r\n"
        "\r\n"
        "Peter NNP I-NP B-PER\r\n"
        "Blackburn NNP I-NP I-PER"
    )
    path = write_text(tmp_path, text)
    assert read_conll(path) == [
        Sentence(("EU", "rejects"), ("B-ORG", "O")),
        Sentence(("Peter", "Blackburn"), ("B-PER", "I-PER")),
    ]


def test_docstart_ends_a_sentence_and_is_skipped(tmp_path):
    text = "a x x O\n-DOCSTART- -X- -X- O\nb x x B-LOC\n\n-DOCSTART- -X- -X- O\n\nc x x O\n"
    assert read_conll(write_text(tmp_path, text)) == [
        Sentence(("a",), ("O",)),
        Sentence(("b",), ("B-LOC",)),
        Sentence(("c",), ("O",)),
    ]


def test_tag_column_selects_another_column(tmp_path):
    path = write_text(tmp_path, "EU B-ORG NNP\nsaid O VBD\n")
    assert read_conll(path, tag_column=1) == [Sentence(("EU", "said"), ("B-ORG", "O"))]
    with pytest.raises(ValueError, match=r"train.txt:1: invalid NER tag 'NNP'"):
        read_conll(path)


def test_too_few_columns_names_file_and_line(tmp_path):
    path = write_text(tmp_path, "-DOCSTART- -X- -X- O\n\nEU\nrejects VBZ I-VP O\n")
    with pytest.raises(ValueError) as err:
        read_conll(path)
    assert str(err.value) == f"{path}:3: expected at least 2 columns, got 1: 'EU'"


def test_invalid_tag_names_file_and_line(tmp_path):
    path = write_text(tmp_path, "EU NNP I-NP B-ORG\n\nPeter NNP I-NP X-PER\n")
    with pytest.raises(ValueError) as err:
        read_conll(path)
    assert str(err.value) == (
        f"{path}:3: invalid NER tag 'X-PER' (expected O, B-TYPE or I-TYPE; BIOES and BILOU tags are read as IOB2): "
        "'Peter NNP I-NP X-PER'"
    )


@pytest.mark.parametrize("bad", ["B-", "I", "B_PER", "o", "S-", "X-PER"])
def test_malformed_tags_rejected(tmp_path, bad):
    path = write_text(tmp_path, f"word POS CHUNK {bad}\n")
    with pytest.raises(ValueError, match=r"train.txt:1: invalid NER tag"):
        read_conll(path)


def test_bioes_and_bilou_files_read_as_their_iob2_equivalent(tmp_path):
    iob2 = ["B-ORG O B-MISC I-MISC I-MISC O B-PER B-PER", "O B-LOC"]
    for scheme, tags in (("bioes", ["S-ORG O B-MISC I-MISC E-MISC O S-PER S-PER", "O S-LOC"]),
                         ("bilou", ["U-ORG O B-MISC I-MISC L-MISC O U-PER U-PER", "O U-LOC"])):
        text = "\n\n".join("\n".join(f"w{i} {t}" for i, t in enumerate(s.split())) for s in tags) + "\n"
        path = tmp_path / f"{scheme}.txt"
        path.write_text(text)
        assert [list(s.tags) for s in read_conll(path)] == [s.split() for s in iob2]
        with pytest.raises(ValueError, match=rf"{scheme}.txt:1: invalid NER tag '[SU]-ORG'"):
            read_conll(path, iob2=False)  # as written: the pipeline's tags are O, B- and I- only


def test_inconsistent_column_count(tmp_path):
    path = write_text(tmp_path, "EU NNP I-NP B-ORG\nNew York NNP I-NP B-LOC\n")
    with pytest.raises(ValueError) as err:
        read_conll(path)
    assert str(err.value) == (
        f"{path}:2: expected 4 columns like line 1, got 5: 'New York NNP I-NP B-LOC'"
    )


def test_tag_column_out_of_range(tmp_path):
    path = write_text(tmp_path, "EU NNP I-NP B-ORG\n")
    with pytest.raises(ValueError, match=r"train.txt:1: tag_column 7 is out of range for 4 columns"):
        read_conll(path, tag_column=7)
    with pytest.raises(ValueError, match=r"train.txt:1: tag_column 0 selects the word column"):
        read_conll(path, tag_column=0)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "train.txt"
    path.write_bytes(b"EU NNP I-NP B-ORG\nM\xfcnchen NNP I-NP B-LOC\n")
    with pytest.raises(ValueError, match=r"train.txt:2: not valid utf-8"):
        read_conll(path)
    assert read_conll(path, encoding="latin-1")[0].tokens == ("EU", "München")


@pytest.mark.parametrize("text", ["", "\n\n", "-DOCSTART- -X- -X- O\n\n"])
def test_no_sentences_is_an_error(tmp_path, text):
    path = write_text(tmp_path, text)
    with pytest.raises(ValueError) as err:
        read_conll(path)
    assert str(err.value).startswith(f"{path}: no sentences found")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_conll(tmp_path / "nope.txt")


@pytest.mark.parametrize(
    "tags, expected",
    [
        (["I-PER", "I-PER", "O"], ("B-PER", "I-PER", "O")),
        (["I-PER", "B-PER", "I-PER"], ("B-PER", "B-PER", "I-PER")),
        (["O", "I-LOC", "I-ORG", "I-ORG"], ("O", "B-LOC", "B-ORG", "I-ORG")),
        (["B-MISC", "I-MISC", "I-LOC"], ("B-MISC", "I-MISC", "B-LOC")),
        (["O", "O"], ("O", "O")),
        ([], ()),
    ],
)
def test_to_iob2(tags, expected):
    assert to_iob2(tags) == expected
    assert to_iob2(expected) == expected


def test_to_iob2_rejects_invalid_tag():
    with pytest.raises(ValueError, match=r"position 1: invalid NER tag 'PER'"):
        to_iob2(["O", "PER"])


def test_sentence_validation_and_coercion():
    s = Sentence(["a", "b"], ["O", "B-X"])
    assert s.tokens == ("a", "b") and s.tags == ("O", "B-X")
    hash(s)
    with pytest.raises(ValueError, match="2 tokens but 1 tags"):
        Sentence(("a", "b"), ("O",))
    with pytest.raises(ValueError, match="no tokens"):
        Sentence((), ())
    with pytest.raises(ValueError, match=r"token 0 \('a'\): invalid NER tag 'B'"):
        Sentence(("a",), ("B",))


@pytest.mark.parametrize("word", ["New York", "tab\there", "", "-DOCSTART-", "line\nbreak"])
def test_write_refuses_unwritable_words(tmp_path, word):
    path = tmp_path / "out.txt"
    with pytest.raises(ValueError, match=r"sentence 1, token 0: cannot write word"):
        write_conll(path, [Sentence(("ok",), ("O",)), Sentence((word,), ("O",))])
    assert not path.exists()


def test_write_refuses_no_sentences(tmp_path):
    with pytest.raises(ValueError, match="no sentences to write"):
        write_conll(tmp_path / "out.txt", [])
