"""Rank pairing across TP sizes: moved to :mod:`moriio_native.pd.tp` (the protocol core owns
it); re-exported here for callers of the old path."""

from moriio_native.pd.tp import expected_releases, read_source, release_targets, releases

__all__ = ["expected_releases", "read_source", "release_targets", "releases"]
