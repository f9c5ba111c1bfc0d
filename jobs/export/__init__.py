"""The export jobs: `export` (encoder.py; llm.py with --task causal-lm; quantized.py with --base-dtype) and
`export-adapter` (adapter.py)."""
