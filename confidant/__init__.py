"""Confidant's command line: glue between the planner (offline) and the runtime (on devices)."""
