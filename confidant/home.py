"""Where the demo keeps its files: $CONFIDANT_HOME, by default ~/.cache/confidant."""
from __future__ import annotations

import os
from pathlib import Path

# an empty CONFIDANT_HOME is unset (Path("") is the working folder: keys would land in ./keys)
DEMO_DIR = Path(os.environ.get("CONFIDANT_HOME") or Path.home() / ".cache" / "confidant")
