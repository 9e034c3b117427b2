"""Seeding, and every rank's RNG streams saved into and restored from a checkpoint (exact resume)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from training_core.parallel.distributed import all_gather_objects


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _json_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached]}


def _torch_rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def gather_rng_states(world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank's RNG states, gathered on all ranks (a collective: every rank must call it)."""
    gathered = all_gather_objects((_json_rng_state(), _torch_rng_state()), world_size)
    return {str(r): g[0] for r, g in enumerate(gathered)}, {str(r): g[1] for r, g in enumerate(gathered)}


def restore_rng(rank: int, json_states: dict[str, Any], torch_states: dict[str, Any]) -> None:
    """Restore this rank's RNG streams; a rank the checkpoint does not know (the job grew) keeps its seed."""
    if (json_state := json_states.get(str(rank))) is not None:
        version, internal, gauss = json_state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = json_state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if (torch_state := torch_states.get(str(rank))) is not None:
        torch.set_rng_state(torch_state["cpu"])
        if "cuda" in torch_state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(torch_state["cuda"])
