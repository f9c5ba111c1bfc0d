"""Causal-LM data (tasks/causal_lm/data.py, tasks/causal_lm/tokenizer.py): packed text and instruction rows, their exact
next-token targets and weights on hand-written examples, micro-batches that sum to the batch."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ir.errors import InputFileError

from tasks.causal_lm.data import (LmBatch, encode_instructions, lm_feeds, load_lm_examples, make_lm_batches,
                           microbatch_feeds, pack_documents, pad_lm_batch, read_instructions, read_text_documents,
                           split_microbatches)
from tasks.causal_lm.metrics import lm_loss
from tasks.causal_lm.tokenizer import ChatPieces, LmTokenizer

WORDS = ["<unk>", "<|im_end|>", "<|im_start|>", "system", "user", "assistant", "Be", "helpful", "What", "is",
         "the", "capital", "?", "Paris", "a", "b", "c", "d", "e"]
ID = {w: i for i, w in enumerate(WORDS)}
EOS = ID["<|im_end|>"]

# ChatML without newlines (the word-level tokenizer drops whitespace), so every id is hand-countable.
PIECES = ChatPieces(
    default_system="<|im_start|> system Be helpful <|im_end|> ",
    prefix={"system": "<|im_start|> system ", "user": "<|im_start|> user ", "assistant": "<|im_start|> assistant "},
    suffix={"system": " <|im_end|> ", "user": " <|im_end|> ", "assistant": " <|im_end|> "},
    generation_prompt="<|im_start|> assistant ")


def _tokenizer(pieces: ChatPieces | None = PIECES) -> LmTokenizer:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return LmTokenizer(tok, pieces, eos_id=EOS, pad_id=EOS)


def ids(text: str) -> list[int]:
    return [ID[w] for w in text.split()]


PROMPT_IDS = ids("<|im_start|> system Be helpful <|im_end|> <|im_start|> user What is the capital ? <|im_end|> "
                 "<|im_start|> assistant")


def test_chat_rendering_and_the_answer_mask():
    tok = _tokenizer()
    messages = [{"role": "user", "content": "What is the capital?"}, {"role": "assistant", "content": "Paris"}]
    assert tok.render_chat(messages[:1]) == ("<|im_start|> system Be helpful <|im_end|> <|im_start|> user What is "
                                            "the capital? <|im_end|> <|im_start|> assistant ")
    assert tok.prompt_ids("What is the capital?") == PROMPT_IDS
    got, counted = tok.encode_chat(messages)
    assert got == PROMPT_IDS + [ID["Paris"], EOS]
    assert counted == [False] * len(PROMPT_IDS) + [True, True]


def test_a_system_message_replaces_the_default_and_multi_turn_counts_every_answer():
    tok = _tokenizer()
    messages = [{"role": "system", "content": "Be"}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d e"}]
    got, counted = tok.encode_chat(messages)
    expected = ids("<|im_start|> system Be <|im_end|> <|im_start|> user a <|im_end|> <|im_start|> assistant b "
                   "<|im_end|> <|im_start|> user c <|im_end|> <|im_start|> assistant d e <|im_end|>")
    assert got == expected
    assert [i for i, c in enumerate(counted) if c] == [10, 11, 18, 19, 20]  # b <|im_end|>, d e <|im_end|>


def test_instruction_batch_targets_and_weights_exactly():
    tok = _tokenizer()
    rows = encode_instructions(tok, [[{"role": "user", "content": "What is the capital?"},
                                      {"role": "assistant", "content": "Paris"}]], seq_len=20)
    (batch,) = make_lm_batches(rows, batch_size=1, seq_len=20, pad_id=tok.pad_id, shuffle=False)
    n = len(PROMPT_IDS)  # 15 prompt tokens, then Paris, <|im_end|>, then 3 positions of padding
    assert batch.input_ids[0].tolist() == PROMPT_IDS + [ID["Paris"], EOS] + [EOS] * 3
    assert batch.attention_mask[0].tolist() == [1] * (n + 2) + [0] * 3
    target_ids = [0] * 20
    target_ids[n - 1], target_ids[n] = ID["Paris"], EOS  # "assistant" predicts Paris, Paris predicts the end
    assert batch.target_ids[0].tolist() == target_ids
    assert batch.target_mask[0].tolist() == [int(t != 0) for t in target_ids]
    assert batch.n_targets == 2
    feeds = lm_feeds(batch)
    assert sorted(feeds) == ["attention_mask", "input_ids", "target_ids", "target_weights"]
    assert feeds["target_weights"].dtype == np.float32 and feeds["target_ids"].dtype == np.int64
    assert feeds["target_weights"][0].tolist() == [0.5 if t else 0.0 for t in target_ids]


def test_packed_text_rows_and_targets_exactly(tmp_path):
    tok = _tokenizer()
    path = tmp_path / "corpus.txt"
    path.write_text("a b\nc\n\n\nd e\n")  # two documents: "a b\nc" and "d e"
    assert read_text_documents(path) == ["a b\nc", "d e"]
    rows = load_lm_examples(path, tok, seq_len=4)  # stream a b c <eos> d e <eos> in rows of 4
    assert [r.ids.tolist() for r in rows] == [ids("a b c <|im_end|>"), ids("d e <|im_end|>")]
    batch = make_lm_batches(rows, 2, 4, tok.pad_id, shuffle=False)[0]
    assert batch.target_ids.tolist() == [[ID["b"], ID["c"], EOS, 0], [ID["e"], EOS, 0, 0]]
    assert batch.target_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]  # the last position has no next token
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    weights = lm_feeds(batch)["target_weights"]
    np.testing.assert_array_equal(weights, np.float32(0.2) * batch.target_mask)


def test_a_rest_of_one_token_has_no_target_and_is_dropped():
    rows = pack_documents(_tokenizer(), ["a b c"], seq_len=2)  # a b | c <eos>
    assert [r.ids.tolist() for r in rows] == [ids("a b"), ids("c <|im_end|>")]
    rows = pack_documents(_tokenizer(), ["a b"], seq_len=2)  # a b | <eos>: the lone <eos> predicts nothing
    assert [r.ids.tolist() for r in rows] == [ids("a b")]


def test_without_a_template_prompt_and_response_are_concatenated():
    tok = _tokenizer(pieces=None)
    got, counted = tok.encode_chat([{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}])
    assert got == ids("a b c <|im_end|>") and counted == [False, False, True, True]
    assert tok.prompt_ids("a b") == ids("a b")
    with pytest.raises(ValueError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "a"}])


def _mixed_batch(tok) -> LmBatch:
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                     for q, a in [("a", "b c"), ("What is the capital?", "Paris"), ("d e a b", "c"), ("e", "a b c d")]]
    rows = encode_instructions(tok, conversations, seq_len=24)
    return make_lm_batches(rows, 4, 24, tok.pad_id, shuffle=False)[0]


@pytest.mark.parametrize("m", [1, 2, 4])
def test_microbatches_sum_to_the_batch_loss_and_logit_gradients(m):
    tok = _tokenizer()
    batch = _mixed_batch(tok)
    assert batch.n_targets == 3 + 2 + 2 + 5
    whole = lm_feeds(batch)
    parts = microbatch_feeds(batch, m)
    np.testing.assert_array_equal(np.concatenate([p["target_weights"] for p in parts]), whole["target_weights"])
    assert np.isclose(whole["target_weights"].sum(), 1.0)
    logits = np.random.default_rng(0).normal(size=(4, 24, len(WORDS))).astype(np.float32)
    rows = 4 // m
    split_loss = sum(lm_loss(logits[k * rows:(k + 1) * rows], p) for k, p in enumerate(parts))
    assert np.isclose(split_loss, lm_loss(logits, whole), rtol=1e-12)

    def grad(lg, f):  # d loss / d logits = weight x (softmax - one-hot)
        p = np.exp(lg - lg.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        p[np.arange(lg.shape[0])[:, None], np.arange(lg.shape[1]), f["target_ids"]] -= 1
        return p * f["target_weights"][..., None]
    split_grad = np.concatenate([grad(logits[k * rows:(k + 1) * rows].astype(np.float64), p)
                                 for k, p in enumerate(parts)])
    np.testing.assert_allclose(split_grad, grad(logits.astype(np.float64), whole), rtol=1e-12)
    micro = split_microbatches(batch, m)
    assert sum(x.n_targets for x in micro) == batch.n_targets


def test_padding_a_short_batch_adds_rows_without_targets():
    tok = _tokenizer()
    batch = make_lm_batches(encode_instructions(tok, [[{"role": "user", "content": "a"},
                                                       {"role": "assistant", "content": "b"}]]), 4, 16,
                            tok.pad_id)[0]
    padded = pad_lm_batch(batch, 3, tok.pad_id)
    assert padded.size == 3 and padded.n_targets == batch.n_targets == 2
    assert padded.attention_mask[1:].sum() == 0 and padded.target_mask[1:].sum() == 0
    np.testing.assert_array_equal(lm_feeds(padded)["target_weights"][0], lm_feeds(batch)["target_weights"][0])


def test_jsonl_layouts_and_errors_name_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    good = [{"prompt": "a", "response": "b"}, {"prompt": "a", "response": "b", "system": "Be"},
            {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}]
    path.write_text("\n".join(json.dumps(g) for g in good) + "\n\n")
    conversations = read_instructions(path)
    assert conversations[0] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert conversations[1][0] == {"role": "system", "content": "Be"}
    assert conversations[2][1] == {"role": "assistant", "content": "d"}
    for bad, match in [("not json", ":2: not a JSON object"), ('{"prompt": "a"}', ":2: expected"),
                       ('{"messages": [{"role": "user", "content": "a"}]}', ":2: no assistant message"),
                       ('{"messages": [{"role": "robot", "content": "a"}]}', r":2: messages\[0\]"),
                       ('{"prompt": "a\\ud800", "response": "b"}', r":2: a string holds '\\ud800', half of a UTF-16"),
                       ("[" * 100_000, ":2: JSON nested too deeply")]:
        path.write_text(json.dumps(good[0]) + "\n" + bad + "\n")
        with pytest.raises(InputFileError, match=match):  # a bad input file: exit status 2
            read_instructions(path)
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(good[0]).encode() + b"\n")  # a byte-order mark is no content
    assert read_instructions(path) == conversations[:1]
    path.write_bytes(b'{"prompt": "\x8f"}\n')
    with pytest.raises(InputFileError, match=r"data.jsonl: not UTF-8 text \(invalid start byte at byte 12\); save it"):
        read_instructions(path)


def test_too_long_is_an_error_unless_truncated():
    tok = _tokenizer()
    conversation = [[{"role": "user", "content": "a b c d e"}, {"role": "assistant", "content": "a b c"}]]
    with pytest.raises(ValueError, match="19 tokens, more than seq_len=17"):
        encode_instructions(tok, conversation, seq_len=17)
    (row,) = encode_instructions(tok, conversation, seq_len=17, truncate=True)
    assert len(row) == 17 and row.n_targets == 2  # the prompt is 15 tokens: "a" and "b" of the answer remain
    with pytest.raises(ValueError, match="no target"):
        encode_instructions(tok, conversation, seq_len=15, truncate=True)
    with pytest.raises(ValueError, match="more than seq_len"):
        make_lm_batches(encode_instructions(tok, conversation), 1, 8, tok.pad_id)


def test_long_conversations_are_cut_or_skipped_and_counted():
    """A conversation longer than the row is cut there; one whose answer starts past it is left out
    (it has nothing to train), and the summary counts both (training used to stop at the first)."""
    from tasks.causal_lm.data import fit_conversations

    tok = _tokenizer()
    short = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    long_answer = [{"role": "user", "content": "a b c d e"}, {"role": "assistant", "content": "a b c"}]  # 19 tokens
    long_prompt = [{"role": "user", "content": "a b c d e a b c d e"}, {"role": "assistant", "content": "a"}]
    fitted = fit_conversations(tok, [short, long_prompt, long_answer, long_prompt], seq_len=17)
    assert [len(r) for r in fitted.rows] == [len(encode_instructions(tok, [short])[0]), 17]
    assert fitted.rows[1].n_targets == 2 and fitted.truncated == 1 and fitted.skipped == (1, 3)
    assert fitted.summary("--data d.jsonl") == (
        "--data d.jsonl: 1 of 4 conversations cut to --seq 17 tokens; 2 of 4 skipped, their answers starting past "
        "token 17 (first: conversation 1); raise --seq to train on them whole")
    assert fit_conversations(tok, [short], seq_len=17).summary("x") is None


def test_a_template_without_pieces_is_refused_not_replaced_by_concatenation():
    tok = _tokenizer(pieces=None)
    tok.template = "{{ messages }}"  # a Jinja template the exporter could not turn into pieces
    with pytest.raises(ValueError, match="cannot be rendered here"):
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ValueError, match="cannot be rendered here"):
        tok.prompt_ids("a")
    assert tok.prompt_ids("a b", raw=True) == ids("a b")
