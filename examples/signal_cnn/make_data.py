"""Write the signal example's data: ``python -m examples.signal_cnn.make_data OUT.npz [SAMPLES] [SEED]``.

Noisy sine, square and sawtooth waves of random frequency and phase, 128 float32 steps each, one channel.
"""

from __future__ import annotations

import sys

import numpy as np

KINDS = ("sawtooth", "sine", "square")


def signals(num_samples: int, seed: int = 0, length: int = 128) -> dict[str, np.ndarray]:
    """``inputs`` [num_samples, 1, length] float32 and ``targets`` (the wave's name), drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, len(KINDS), num_samples)
    cycles = rng.uniform(2, 6, (num_samples, 1)) * np.linspace(0, 1, length) + rng.uniform(0, 1, (num_samples, 1))
    phase = cycles % 1.0
    waves = np.stack([2 * phase - 1, np.sin(2 * np.pi * phase), np.where(phase < 0.5, 1.0, -1.0)])
    inputs = waves[kinds, np.arange(num_samples)] + rng.normal(0, 0.3, (num_samples, length))
    return {"inputs": inputs[:, None, :].astype(np.float32), "targets": np.asarray(KINDS)[kinds]}


if __name__ == "__main__":
    out, count, seed = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 600, int(sys.argv[3:4] or [0])
    np.savez(out, **signals(count, seed))
    print(f"wrote {count} signals to {out}")
