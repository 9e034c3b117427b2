"""Flyte adapters around training_core: typed inputs/outputs, artifacts, Decks, caching and Ray wiring."""
