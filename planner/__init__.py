"""Confidant's offline planner: ONNX lowering, graph passes, partitioning, scheduling, bundles."""
