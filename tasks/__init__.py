"""Flyte adapters around training_core: typed inputs/outputs, artifacts, Decks, caching and Ray wiring."""

from tasks import flyte_types

flyte_types.install()
