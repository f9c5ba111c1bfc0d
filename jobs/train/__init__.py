"""The training jobs: `train-local` (local.py; causal_lm.py with --task causal-lm), `train-pipeline`
(pipeline.py) and `train PLAN` (from_plan.py), with what the two pipeline jobs share (pipeline_run.py,
pipeline_tasks.py)."""
