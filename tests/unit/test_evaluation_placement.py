"""Where ``evaluate`` runs: the task's own process unless an FSDP model's whole weights do not fit it."""

from __future__ import annotations

import pytest

from training_core.config import TrainingConfig
from training_core.evaluation import GATHER_BYTES_PER_PARAMETER, evaluation_placement

GIB = 2**30
FITS_8_GIB = 8 * GIB // GATHER_BYTES_PER_PARAMETER  # 1.07 B parameters


@pytest.mark.parametrize(
    ("sections", "num_parameters", "placement"),
    [
        ({}, 10 * FITS_8_GIB, "process"),  # DDP: every worker held the whole model, so one process holds it too
        ({"scaling": {"strategy": "fsdp"}}, FITS_8_GIB, "process"),
        ({"scaling": {"strategy": "fsdp"}}, FITS_8_GIB + 1, "cluster"),
        ({"scaling": {"strategy": "fsdp"}, "evaluation": {"process_memory_gib": 16}}, FITS_8_GIB + 1, "process"),
        ({"scaling": {"strategy": "fsdp"}}, 0, "process"),  # a checkpoint older than the count
        ({"evaluation": {"placement": "cluster"}}, 1000, "cluster"),
        ({"scaling": {"strategy": "fsdp"}, "evaluation": {"placement": "process"}}, 10 * FITS_8_GIB, "process"),
    ],
)
def test_auto_evaluates_on_the_cluster_only_an_fsdp_model_too_large_for_the_process(
    sections, num_parameters, placement
):
    model = {"model": {"name": "resnet18"}} if sections.get("scaling") else {}
    cfg = TrainingConfig.from_dict({**sections, **model})
    assert evaluation_placement(cfg, num_parameters) == placement
