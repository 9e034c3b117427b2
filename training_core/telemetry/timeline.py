"""The bounded timeline of rank 0's samples that checkpoints carry to the Deck.

Contract: a :class:`Timeline` keeps at most ``max_samples`` samples (dicts, stored as given) however long the run:
when full it drops every other one and from then on keeps one new sample in two (then four, ...), so the whole run
stays covered at a coarser interval. Built with a checkpoint's saved samples and ``stride``, it continues them at
the interval they had reached. It has no lock of its own: the exporter holds its lock around it.
"""

from __future__ import annotations

from typing import Any


class Timeline:
    """At most ``max_samples`` readings for the Deck (see the module docstring)."""

    def __init__(self, max_samples: int, samples: list[dict[str, Any]] | None = None, stride: int = 1) -> None:
        self.max_samples = max_samples
        self.samples: list[dict[str, Any]] = list(samples or [])
        self.stride = stride
        """One sample kept in ``stride`` added."""
        self._skipped = 0

    def add(self, sample: dict[str, Any]) -> None:
        self._skipped += 1
        if self._skipped < self.stride:
            return
        self._skipped = 0
        self.samples.append(sample)
        if len(self.samples) >= self.max_samples:
            self.samples = self.samples[::2]
            self.stride *= 2
