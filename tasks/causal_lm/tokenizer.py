"""A causal LM's tokenizer and chat template, as `confidant export --task causal-lm` writes them.

Beside `NAME.onnx` the exporter writes `tokenizer.json` (read with the `tokenizers` library, through
tasks/tokenize.py's loader) and `chat_template.json`: the model's Jinja template, the same template as
plain text pieces, and the special tokens. Rendering uses the pieces, so no Jinja engine is needed on a
device; the exporter checked them against transformers' rendering of the template:

    text = default_system (only when the first message is not a system message)
         + for each message: prefix[role] + content + suffix[role]
         + generation_prompt (when the model is to answer next)

SmolLM2's template (ChatML) gives `<|im_start|>user\\nQ<|im_end|>\\n<|im_start|>assistant\\n`, preceded by
its default system message. A model without a template (a base model, a random test model) has
`pieces: null`; `render_chat` then refuses, and `encode_chat` falls back to plain concatenation
(prompt, then response and the end-of-sequence token). A template that exists but has no pieces (one
that moves or rewrites messages) is refused instead: only raw prompts work with it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from ir.errors import InputFileError
from ir.versioned import check_header
from tasks.tokenize import load_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["CHAT_TEMPLATE_FILE", "TOKENIZER_FILE", "ChatPieces", "LmTokenizer", "Message", "ROLES",
           "load_lm_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.json"
ROLES = ("system", "user", "assistant")

Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant", "content": str}


def check_messages(messages: Sequence[Message], where: str = "messages") -> list[dict[str, str]]:
    """Messages as plain dicts, or a ValueError naming the first bad one."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of {{'role', 'content'}} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}[{i}]: expected {{'role': one of {', '.join(ROLES)}, 'content': text}}, "
                             f"got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


@dataclass(frozen=True)
class ChatPieces:
    """A chat template as text pieces (see the module docstring)."""
    default_system: str
    prefix: Mapping[str, str]
    suffix: Mapping[str, str]
    generation_prompt: str

    @classmethod
    def from_json(cls, d: Mapping) -> "ChatPieces":
        for key in ("prefix", "suffix"):
            missing = [r for r in ROLES if r not in d[key]]
            if missing:
                raise ValueError(f"chat template pieces: {key} has no {missing[0]!r} role")
        return cls(str(d["default_system"]), dict(d["prefix"]), dict(d["suffix"]), str(d["generation_prompt"]))

    def turns(self, messages: Sequence[Message], generation_prompt: bool = False) -> list[tuple[str, str | None]]:
        """The rendered conversation as (text, role of the message whose content this is, or None for
        template text), in order; joined, the texts are the rendering."""
        messages = check_messages(messages)
        out: list[tuple[str, str | None]] = []
        if messages[0]["role"] != "system":
            out.append((self.default_system, None))
        for m in messages:
            out += [(self.prefix[m["role"]], None), (m["content"], m["role"]), (self.suffix[m["role"]], m["role"])]
        if generation_prompt:
            out.append((self.generation_prompt, None))
        return [(text, role) for text, role in out if text]

    def render(self, messages: Sequence[Message], generation_prompt: bool = False) -> str:
        return "".join(text for text, _ in self.turns(messages, generation_prompt))


class LmTokenizer:
    """tokenizer.json + chat_template.json: encoding, decoding, the chat template, the special ids."""

    def __init__(self, tokenizer: "Tokenizer", pieces: ChatPieces | None, eos_id: int | None,
                 pad_id: int | None, bos_id: int | None = None, adds_bos: bool = False, template: str | None = None):
        self.tokenizer = tokenizer
        self.pieces = pieces
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        self.bos_id = bos_id
        self.adds_bos = adds_bos  # the tokenizer's post-processor puts bos first (add_special_tokens=True)
        self.template = template

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self.pieces is not None

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of `text`; `special` lets the post-processor add what it adds (a bos token for
        some models, nothing for SmolLM2). Special tokens written in the text (`<|im_end|>`) are
        matched as single tokens either way."""
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render_chat(self, messages: Sequence[Message], generation_prompt: bool = True) -> str:
        if self.pieces is None:
            raise ValueError("this model's tokenizer has no chat template (chat_template.json has no pieces): "
                             "give a raw prompt (`--raw`) or prompt/response data")
        return self.pieces.render(messages, generation_prompt)

    def _check_plain(self) -> None:
        """Plain concatenation stands in for a missing template, never for one that exists."""
        if self.template is not None:
            raise ValueError("this model's chat template moves or rewrites messages, so it has no plain-text pieces "
                             "(chat_template.json) and cannot be rendered here; give raw prompts (`--raw`)")

    def prompt_ids(self, prompt: str | Sequence[Message], raw: bool = False) -> list[int]:
        """The ids a model answers from: the chat template with a generation prompt, or (`raw`, or no
        template) the text itself with the post-processor's special tokens; messages without a
        template are concatenated as `encode_chat` does."""
        if isinstance(prompt, str):
            if raw or (self.pieces is None and self.template is None):
                return self.encode(prompt, special=True)
            prompt = [{"role": "user", "content": prompt}]
        if self.pieces is None:
            self._check_plain()
            return self._encode_plain(check_messages(prompt))[0]
        return self.encode(self.render_chat(prompt, generation_prompt=True))

    def encode_chat(self, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
        """(ids, counted) of a conversation: `counted[i]` when token i belongs to an assistant message
        (its content and its suffix up to and including the end-of-sequence token), the tokens a model
        is trained to produce. Each assistant part is tokenised on its own, after the text before it, so
        the prompt's tokens are exactly what `prompt_ids` gives at generation time."""
        messages = check_messages(messages)
        if self.pieces is None:
            self._check_plain()
            return self._encode_plain(messages)
        ids: list[int] = []
        counted: list[bool] = []
        context = ""
        turns = self.pieces.turns(messages)
        k = 0
        while k < len(turns):
            text, role = turns[k]
            if role != "assistant":
                context += text
                k += 1
                continue
            answer = ""
            while k < len(turns) and turns[k][1] == "assistant":
                answer += turns[k][0]
                k += 1
            if context:
                ids += self.encode(context)
                counted += [False] * (len(ids) - len(counted))
                context = ""
            answer_ids = self.encode(answer)
            ids += answer_ids
            counted += self._answer_counted(answer_ids)
        if context:
            ids += self.encode(context)
            counted += [False] * (len(ids) - len(counted))
        return ids, counted

    def _answer_counted(self, answer_ids: Sequence[int]) -> list[bool]:
        """Everything up to the first end-of-sequence token counts; the template's text after it (a
        newline between turns) is never generated, so it is not trained."""
        if self.eos_id is not None and self.eos_id in answer_ids:
            end = list(answer_ids).index(self.eos_id) + 1
            return [True] * end + [False] * (len(answer_ids) - end)
        return [True] * len(answer_ids)

    def _encode_plain(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        """Without a chat template: contents concatenated; each assistant content is followed by eos."""
        ids: list[int] = []
        counted: list[bool] = []
        for i, m in enumerate(messages):
            part = self.encode(m["content"], special=(i == 0))
            if m["role"] == "assistant":
                if self.eos_id is not None:
                    part = part + [self.eos_id]
                counted += [True] * len(part)
            else:
                counted += [False] * len(part)
            ids += part
        return ids, counted


def load_lm_tokenizer(path: str | Path) -> LmTokenizer:
    """The tokenizer of a causal LM: `path` is the model's .onnx file, its folder, or a tokenizer.json
    (chat_template.json is read from the same folder; without one there is no template and no eos)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    tokenizer_file = path if path.name.endswith(".json") and path.is_file() else folder / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} beside {path}: `confidant export --task causal-lm` writes "
                                "one when the checkpoint has a tokenizer (a random or tokenizer-less model has none)")
    tokenizer = load_tokenizer(tokenizer_file)
    chat_file = tokenizer_file.parent / CHAT_TEMPLATE_FILE
    if not chat_file.is_file():
        return LmTokenizer(tokenizer, None, None, None)
    try:
        d = json.loads(chat_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputFileError(f"{chat_file}: not valid JSON ({exc}); re-export the model "
                             "(`confidant export --task causal-lm`) or delete the file for raw prompts") from None
    check_header(d, format="confidant-chat-template", versions=None, where=str(chat_file),
                 redo="re-export the model (`confidant export --task causal-lm`)")
    pieces = ChatPieces.from_json(d["pieces"]) if d.get("pieces") else None
    return LmTokenizer(tokenizer, pieces, d.get("eos_token_id"), d.get("pad_token_id"), d.get("bos_token_id"),
                       bool(d.get("adds_bos")), d.get("template"))
