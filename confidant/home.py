"""Where the demo keeps its files: $CONFIDANT_HOME, by default ~/.cache/confidant."""
from __future__ import annotations

import os
from pathlib import Path

DEMO_DIR = Path(os.environ.get("CONFIDANT_HOME", Path.home() / ".cache" / "confidant"))
