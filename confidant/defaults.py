"""Defaults and fixed sets the command line's parser and its commands share (one place, no import circle)."""
from __future__ import annotations

# What a plan fixes (its bundles were compiled for them): `train PLAN` refuses other values of these flags.
PLAN_FIXED = ("batch", "seq", "lr", "optimizer", "threads", "engine")

# the NER demo's training defaults: its generated sentences are at most 28 WordPiece tokens long
# (padding them to 128 would spend three quarters of the compute on padding)
DEMO_DEFAULTS = {"steps": 60, "batch": 8, "seq": 32, "lr": 1e-4, "threads": 1}
