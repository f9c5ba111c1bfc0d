"""The parts of benchmarks/planner.py, one module each, and the helpers they share.

Run them through the entry point, ``.venv/bin/python benchmarks/planner.py --parts a,b,c,d``; its
docstring says what each part measures. Modules:
- ``shared``: constants (batch, sequence, optimizer, schedules, backend) and the text helpers of every part;
- ``minilm``: parts (a) and (d): profiling this machine, planning N identical devices, the predictions
  (cost formula, simulation) and the measured figures of a training run, and their common table;
- ``synthetic``: parts (b) and (c): synthetic models and clusters, the watched CP-SAT solve, the
  PipeDream-style DP;
- ``part_a`` .. ``part_d``: each part's run (``part_X``) and its text (``format_X``).
"""
