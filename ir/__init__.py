"""Confidant's shared vocabulary: graph IR, profiles and plans as plain data (stdlib + numpy only)."""
