"""Evaluation of a causal LM on instruction data: perplexity of the answers and exact match of generated
answers (plus the entity task's scores when the answers are its JSON).

`model` is anything with `logits(input_ids, attention_mask) -> [B, S, V]` and
`generate(prompt_ids, settings, stop_ids) -> ids` (tasks/causal_lm/generate.py's OnnxCausalLM on the exported
file, with or without trained weights); a lowered graph's logits fit `dev_perplexity` too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tasks.causal_lm.entity_task import parse_answer, score_answers
from tasks.causal_lm.data import encode_instructions, make_lm_batches
from tasks.causal_lm.metrics import NllSum, exact_match

if TYPE_CHECKING:
    from tasks.causal_lm.generate import GenerationSettings
    from tasks.causal_lm.tokenizer import LmTokenizer

__all__ = ["InstructionScores", "StagedGreedyLM", "answer_index", "dev_perplexity", "engine_nll",
           "evaluate_instructions", "generated_answers", "lookup_draft", "ranged_nll", "staged_nll"]


@dataclass(frozen=True)
class InstructionScores:
    n_examples: int
    perplexity: float | None  # of the reference answers' tokens given their prompts; None: not asked
    exact_match: float  # of greedy (or sampled) answers vs the references
    task: dict | None  # the entity task's scores (valid_json, precision, recall, f1), when its JSON
    predictions: tuple[str, ...]

    def to_json(self) -> dict:
        return {"n_examples": self.n_examples, "perplexity": self.perplexity, "exact_match": self.exact_match,
                "task": self.task}


def dev_perplexity(model, tokenizer: "LmTokenizer", conversations: Sequence, batch: int = 8,
                   seq: int | None = None) -> float:
    """Perplexity of the assistant tokens over all `conversations` (one sum over every batch)."""
    rows = encode_instructions(tokenizer, conversations, seq)
    seq = seq or max(len(r) for r in rows)
    total = NllSum()
    for b in make_lm_batches(rows, batch, seq, tokenizer.pad_id, shuffle=False):
        total.add(model.logits(b.input_ids, b.attention_mask), b)
    return total.perplexity


def generated_answers(model, tokenizer: "LmTokenizer", conversations: Sequence, settings: "GenerationSettings",
                      batch: int = 8) -> list[str]:
    """The model's answer to each conversation's messages before its last assistant message."""
    prompts = []
    for messages in conversations:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompts.append(tokenizer.prompt_ids(list(messages[:last])))
    stop = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    out = []
    for lo in range(0, len(prompts), batch):
        out += [tokenizer.decode(ids) for ids in model.generate(prompts[lo:lo + batch], settings, stop)]
    return out


def evaluate_instructions(model, tokenizer: "LmTokenizer", conversations: Sequence, settings: "GenerationSettings",
                          batch: int = 8, perplexity: bool = True) -> InstructionScores:
    """Perplexity and exact match on instruction conversations (their last assistant message is the
    reference answer). `perplexity` False: generation only (the caller scores the perplexity on an
    engine of its own), so `model.logits`, and the whole-sequence graph it runs, is never needed."""
    conversations = list(conversations)
    references = [[m for m in c if m["role"] == "assistant"][-1]["content"] for c in conversations]
    predictions = generated_answers(model, tokenizer, conversations, settings, batch)
    task = None
    if all(parse_answer(r) is not None for r in references):
        task = {k: v for k, v in score_answers(predictions, references).items() if k != "exact_match"}
    ppl = dev_perplexity(model, tokenizer, conversations, batch) if perplexity else None
    return InstructionScores(len(conversations), ppl, exact_match(predictions, references), task, tuple(predictions))


def engine_nll(engine, batches: Sequence, rows: int, pad_id: int = 0) -> NllSum:
    """Summed answer NLL and target count of `batches` (tasks/causal_lm/data.py's LmBatch) on a stage engine
    holding a whole lowered causal LM (batch `rows`): each batch's loss, with the weights 1 / its own
    count, times that count. The engine's loss never makes the vocabulary-sized logits
    (`runtime.engines.lm_loss`)."""
    from tasks.causal_lm.data import lm_feeds, pad_lm_batch

    total = NllSum()
    for b in batches:
        if b.n_targets == 0:
            continue
        loss = float(engine.forward(lm_feeds(pad_lm_batch(b, rows, pad_id)), train=False))
        total.nll += loss * b.n_targets
        total.n_targets += b.n_targets
    return total


def ranged_nll(engine_of_range, ranges: Sequence[tuple[int, int]], batches: Sequence, rows: int,
               pad_id: int = 0) -> NllSum:
    """`engine_nll` of a whole lowered causal LM run a block range at a time: `engine_of_range(first,
    last)` builds the stage engine of blocks first..last, which runs every batch to its boundary
    activations (the next range's input) and is let go before the next one is built, so one range's
    weights are held at a time, not the whole model's (the last range's output is each batch's loss).
    The same figure as `engine_nll` on one engine of the whole model: each block computes as it
    would there, on the same inputs."""
    from tasks.causal_lm.data import lm_feeds, pad_lm_batch

    scored = [b for b in batches if b.n_targets]
    feeds = [lm_feeds(pad_lm_batch(b, rows, pad_id)) for b in scored]
    outs: list = [None] * len(scored)
    for first, last in ranges:
        engine = engine_of_range(first, last)
        spec = engine.spec
        for k, f in enumerate(feeds):
            given = {n: f[n] for n in spec.graph_inputs}
            if spec.activation_input is not None:
                given[spec.activation_input] = outs[k]
            outs[k] = np.array(engine.forward(given, train=False))  # its own copy: the engine goes next
        del engine
    total = NllSum()
    for b, loss in zip(scored, outs):
        total.nll += float(np.asarray(loss).reshape(-1)[0]) * b.n_targets
        total.n_targets += b.n_targets
    return total


def staged_nll(forward_loss, rows_of_dev: Sequence, rows: int, seq: int, pad_id: int = 0) -> NllSum:
    """`engine_nll` of the dev rows on a pipeline's stages, which hold the trained weights: the rows
    in micro-batches of `rows` (the stages' graph), each with the weights 1 / its own count, run
    forward only through the stages by `forward_loss(feeds per micro-batch) -> loss per micro-batch`
    (runtime.pipeline.coordinator.Coordinator.forward_only), each loss times its count. The same sum
    as `engine_nll` on one engine of the whole model, up to float32 rounding of the per-row sums."""
    from tasks.causal_lm.data import lm_feeds, make_lm_batches, pad_lm_batch

    scored = [b for b in make_lm_batches(rows_of_dev, rows, seq, pad_id, shuffle=False) if b.n_targets]
    losses = forward_loss([lm_feeds(pad_lm_batch(b, rows, pad_id)) for b in scored]) if scored else []
    total = NllSum()
    for b, loss in zip(scored, losses):
        total.nll += float(loss) * b.n_targets
        total.n_targets += b.n_targets
    return total


def answer_index(answers: Sequence[Sequence[int]], longest: int = 3, follow: int = 16
                 ) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Each n-gram (n = 1..`longest`) of `answers` (token lists: the training rows' answers) and the
    `follow` tokens after its first occurrence: `lookup_draft`'s second source, the skeleton a
    fine-tuned model's answers share (the entity task's JSON keys and brackets, which its prompts
    do not hold)."""
    index: dict[tuple[int, ...], tuple[int, ...]] = {}
    for answer in answers:
        a = [int(t) for t in answer]
        for n in range(1, longest + 1):
            for start in range(len(a) - n):
                index.setdefault(tuple(a[start:start + n]), tuple(a[start + n:start + n + follow]))
    return index


def lookup_draft(sequence: Sequence[int], limit: int, longest: int = 3,
                 index: dict[tuple[int, ...], tuple[int, ...]] | None = None) -> list[int]:
    """Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n = `longest` down to 1), else, with `index` (`answer_index`), those
    that followed them in an answer, at most `limit` of them; [] when none recurs. A guess only
    (`StagedGreedyLM` keeps what the model's own argmax confirms), and a good one where the answer
    copies its prompt (the entity task's JSON lists names from the sentence) or repeats itself."""
    if limit <= 0:
        return []
    seq = list(sequence)
    for n in range(min(longest, len(seq)), 0, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + limit]
        if index is not None and tuple(tail) in index:
            return list(index[tuple(tail)][:limit])
    return []


class StagedGreedyLM:
    """Greedy generation through a forward of fixed shape (a pipeline's stages, lowered at `rows` x
    `seq`): each pass is one forward-only pass of every unfinished row's whole sequence, right
    padded to `seq` (the causal mask keeps the padding out of every position before it), `rows` rows
    a micro-batch; `next_tokens(feeds per micro-batch, positions per micro-batch)` returns each
    row's highest-logit token at each of its positions (int64 [rows, k] for positions [rows, k]; the
    first one on a tie, as numpy's and torch's argmax pick), computed where the logits are (the
    stage holding the LM head). With the same weights, the tokens of ONNX Runtime's greedy
    generation (`tasks.causal_lm.generate`), computed again over the whole sequence instead of from
    a key/value cache.

    The graph's positions past a row's last token are otherwise padding, so a pass fills them with a
    drafted continuation (`draft(sequence, limit) -> tokens`, by default `lookup_draft`: copied from
    earlier in the sequence, at most `max_draft` tokens) and reads the argmax at the row's last
    position and at each drafted one: the causal mask makes the argmax at a drafted position the
    greedy token after the sequence up to it, so the drafted tokens are kept while they equal the
    argmax before them, and the argmax after the last kept one is one more token (speculative
    decoding checked by the model itself). A pass gives each row 1 to 1 + its draft's length
    tokens, the same ones a pass per token would give; a wrong draft costs only the head's
    projection at its positions. `draft=None`: one token a pass.

    A row stops at a stop id (kept), after `max_new_tokens`, or when it fills `seq` positions (no
    position past the graph's exists): a conversation that fits `seq` fits its reference answer,
    so only an answer longer than that is cut. `generate` is what `generated_answers` calls."""

    def __init__(self, next_tokens, rows: int, seq: int, pad_id: int = 0, draft=lookup_draft, max_draft: int = 16):
        self.next_tokens, self.rows, self.seq, self.pad_id = next_tokens, rows, seq, pad_id
        self.draft, self.max_draft = draft, max(0, int(max_draft)) if draft is not None else 0
        self.passes = 0  # forward passes run (each over every unfinished row)
        self.drafted = self.accepted = 0  # drafted tokens fed, and those the argmax confirmed
        self.tokens = 0  # tokens generated

    def generate(self, prompts: Sequence[Sequence[int]], settings: "GenerationSettings",
                 stop_ids: Sequence[int] = ()) -> list[list[int]]:
        from tasks.causal_lm.data import LmBatch, lm_feeds

        if settings.temperature != 0:
            raise ValueError("generation through the pipeline's stages is greedy only (temperature 0)")
        prompts = [[int(t) for t in p] for p in prompts]
        if any(not p for p in prompts):
            raise ValueError("an empty prompt: give at least one token (a bos token, for a raw start)")
        stop = {int(s) for s in stop_ids}
        out: list[list[int]] = [[] for _ in prompts]
        active = [i for i, p in enumerate(prompts) if len(p) < self.seq] if settings.max_new_tokens else []
        while active:
            drafts = {}
            for i in active:
                sequence = prompts[i] + out[i]
                # room for the draft and the token after it: both within `seq` and max_new_tokens
                room = min(self.seq - len(sequence), settings.max_new_tokens - len(out[i])) - 1
                limit = min(room, self.max_draft)
                drafts[i] = [int(t) for t in self.draft(sequence, limit)][:limit] if limit > 0 else []
            k = 1 + max(len(d) for d in drafts.values())
            feeds, positions, groups = [], [], []
            for lo in range(0, len(active), self.rows):
                group = active[lo:lo + self.rows]
                # a short last micro-batch repeats its first row (its tokens are not read)
                filled = group + [group[0]] * (self.rows - len(group))
                ids = np.full((self.rows, self.seq), self.pad_id, np.int64)
                mask = np.zeros((self.rows, self.seq), np.int64)
                at = np.zeros((self.rows, k), np.int64)
                for r, i in enumerate(filled):
                    row = prompts[i] + out[i] + drafts[i]
                    ids[r, :len(row)] = row
                    mask[r, :len(row)] = 1
                    last = len(prompts[i]) + len(out[i]) - 1
                    # the row's last position, then each drafted one (a shorter draft repeats its last)
                    at[r] = np.minimum(last + np.arange(k), last + len(drafts[i]))
                zeros = np.zeros_like(ids)
                feeds.append(lm_feeds(LmBatch(ids, mask, zeros, zeros.copy(), 0)))
                positions.append(at)
                groups.append(group)
            picked = self.next_tokens(feeds, positions)
            self.passes += 1
            for group, tokens in zip(groups, picked):
                tokens = np.asarray(tokens).reshape(self.rows, k)
                for r, i in enumerate(group):
                    draft = drafts[i]
                    self.drafted += len(draft)
                    new = [int(tokens[r, 0])]
                    while len(new) <= len(draft) and new[-1] not in stop and new[-1] == draft[len(new) - 1]:
                        new.append(int(tokens[r, len(new)]))
                    self.accepted += len(new) - 1
                    self.tokens += len(new)
                    out[i] += new
            active = [i for i in active
                      if out[i][-1] not in stop and len(out[i]) < settings.max_new_tokens
                      and len(prompts[i]) + len(out[i]) < self.seq]
        return out
