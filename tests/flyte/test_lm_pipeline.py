"""``pyflyte run`` of the training pipeline with the built-in ``causal_lm`` workload: a tiny GPT on the standard
library's source, end to end (prep, Ray Train on 2 CPU workers, evaluation, registration)."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.mlflow_db import seed_mlflow_db
from tests.helpers.pyflyte import flat, pyflyte_run

CONFIG = REPO_ROOT / "examples" / "gpt_stdlib.yaml"
MODEL_NAME = "stdlib-gpt"


@pytest.fixture(scope="module")
def lm_run(ray_address, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lm-pipeline")
    home = workdir / "home"
    home.mkdir()
    seed_mlflow_db(workdir / "mlflow.db")  # the example's relative tracking URI, in the run's directory
    env = dict(os.environ, HOME=str(home), PYTHONUNBUFFERED="1", RAY_ADDRESS=ray_address)
    result = pyflyte_run("--config", str(CONFIG), cwd=workdir, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return workdir, output


def _unigram_perplexity(tokens: np.ndarray) -> float:
    """Perplexity of the split's own unigram distribution over the predicted tokens (every position but the first
    of each sequence): the best a model that ignores context can do on it."""
    targets = tokens[:, 1:].reshape(-1)
    counts = np.bincount(targets).astype(np.float64)
    probabilities = counts[targets] / len(targets)
    return float(math.exp(-np.log(probabilities).mean()))


@pytest.mark.slow
def test_a_tiny_gpt_beats_half_the_unigram_perplexity_and_its_champion_loads_and_generates(lm_run, tmp_path):
    import mlflow
    import torch
    from mlflow.tracking import MlflowClient

    from training_core.config import TrainingConfig, read_yaml_mapping
    from training_core.data import ShardStream, prepare
    from training_core.workloads.causal_lm import greedy_decode, read_tokenizer

    workdir, output = lm_run
    config = TrainingConfig.from_dict(read_yaml_mapping(CONFIG))
    # Prep is deterministic: preparing again gives the test split the pipeline evaluated on.
    manifest = prepare(config.data, str(tmp_path / "data"), workload=config.workload)
    tokens = np.concatenate(
        [b["tokens"] for b in ShardStream(manifest, "test", rank=0, world_size=1).eval_batches(batch_size=4096)]
    )
    unigram = _unigram_perplexity(tokens)

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    version = client.get_model_version_by_alias(MODEL_NAME, "champion")
    test_perplexity = float(version.tags["test_perplexity"])
    assert test_perplexity <= unigram / 2, (test_perplexity, unigram)
    assert "test_perplexity" in flat(output) and "(alias 'champion' -> v1)" in output
    run = client.get_run(version.run_id)
    assert run.data.metrics["test_perplexity"] == pytest.approx(test_perplexity)
    assert run.data.metrics["test_accuracy"] > 0.3  # next-byte accuracy of Python source
    assert run.data.metrics["tokens_per_s"] > 0

    # The registry holds a torch.export program (no pickled code) that takes any batch and sequence length.
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    model = mlflow.pytorch.load_model(f"models:/{MODEL_NAME}@champion")
    ids = torch.tensor(tokens[:2, :16], dtype=torch.long)
    assert model(ids).shape == (2, 16, manifest.spec["vocab_size"])
    generated = greedy_decode(model, ids, 8, context_length=config.data.seq_len)
    assert generated.shape == (2, 24) and torch.equal(generated[:, :16], ids)
    # The registered model is the trained one: it predicts the test split's next bytes as well as evaluation said.
    batch = torch.tensor(tokens[:64], dtype=torch.long)
    predicted = model(batch[:, :-1]).argmax(dim=-1)
    assert (predicted == batch[:, 1:]).float().mean() > 0.3
    tokenizer = read_tokenizer(manifest)
    prompt = torch.tensor([tokenizer.encode("def ").tolist()], dtype=torch.long)
    text = tokenizer.decode(greedy_decode(model, prompt, 16, context_length=config.data.seq_len)[0].tolist())
    assert text.startswith("def ") and len(text) > len("def ")


@pytest.mark.slow
def test_the_evaluation_report_shows_perplexity_the_validation_curve_and_continuations(lm_run):
    _, output = lm_run
    match = re.search(r"evaluation report: (\S+)", output)
    assert match, output[-3000:]
    page = open(match.group(1), encoding="utf-8").read()
    for section_id in ("metrics", "validation", "continuations"):
        assert f"id='{section_id}'" in page
    assert "perplexity (lower is better)" in page and "id='confusion'" not in page
