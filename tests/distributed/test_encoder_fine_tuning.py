"""A tiny pretrained BERT fine-tuned by the ``sequence_classification`` workload on 2 gloo workers of the shared Ray
cluster, evaluated from its checkpoint, registered in MLflow, and the champion classifying raw strings."""

from __future__ import annotations

import json

from tests.helpers.labeled_text import labeled_rows, tiny_bert, wordpiece_tokenizer, write_jsonl
from training_core.config import TrackingConfig, TrainingConfig
from training_core.data import prepare
from training_core.records import MlflowRun


def test_a_pretrained_tiny_bert_fine_tunes_on_two_workers_evaluates_and_its_champion_classifies_strings(
    ray_session, tmp_path
):
    import mlflow

    from training_core.evaluation import evaluate_checkpoint
    from training_core.runners.ray_train import fit
    from training_core.tracking import create_run, register_and_promote
    from training_core.workloads.sequence_classification import load_classifier

    rows = labeled_rows(360, seed=3)
    bert_dir = tmp_path / "bert"
    wordpiece_tokenizer(bert_dir / "tokenizer.json", [text for text, _ in rows])
    vocab = json.loads((bert_dir / "tokenizer.json").read_text())["model"]["vocab"]
    tiny_bert(bert_dir, vocab_size=len(vocab), num_labels=3)
    cfg = TrainingConfig.from_dict(
        {
            "workload": {"name": "sequence_classification", "primary_metric": "macro_f1"},
            "data": {
                "dataset": "labeled_text",
                "path": str(write_jsonl(tmp_path / "rows.jsonl", rows)),
                "tokenizer": str(bert_dir),
                "seq_len": 16,
                "num_shards": 2,
            },
            "model": {"name": "", "pretrained": str(bert_dir)},
            "optimizer": {"name": "adamw", "lr": 0.01},
            "schedule": {"warmup_steps": 2},
            "loop": {"epochs": 4, "batch_size": 16, "log_interval_steps": 4},
            "scaling": {"num_workers": 2},
            "observability": {"enabled": False},
        }
    )
    data_dir = str(tmp_path / "data")
    prepare(cfg.data, data_dir, workload=cfg.workload)
    tracking = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", registered_model_name="tickets")
    uri, run_id = create_run(tracking, run_name="bert")
    result = fit(cfg, data_dir=data_dir, checkpoint_dir=str(tmp_path / "final"), run_name="bert-fine-tune",
                 storage_path=str(tmp_path / "ray"), mlflow_run=MlflowRun(uri, run_id))  # fmt: skip
    history = result.meta.history
    assert len(history) == 4 and history[-1].val_accuracy > 0.8 > 1 / 3  # three classes: chance is a third
    assert history[-1].train_loss < history[0].train_loss
    report = evaluate_checkpoint(result.checkpoint_dir, data_dir)
    assert (report.workload, report.primary_metric, report.primary_mode) == (
        "sequence_classification",
        "macro_f1",
        "max",
    )
    assert report.metrics["accuracy"] > 0.8 and report.primary == report.metrics["macro_f1"] > 0.8
    assert report.classes == ["color", "fruit", "metal"] and sum(map(sum, report.confusion)) == report.num_samples

    # The loop logged a torch.export program (no pickle) with the tokenizer and classes beside it.
    promotion = register_and_promote(tracking, model_uri=result.meta.mlflow_model_uri, run_id=run_id,
                                     metric="test_macro_f1", value=report.primary, mode="max")  # fmt: skip
    assert promotion.promoted
    mlflow.set_tracking_uri(uri)
    champion = load_classifier("models:/tickets@champion")
    texts = ["apple mango with the peach", "some iron and zinc of tin", "a red and blue purple", ""]
    assert champion.classes == report.classes and len(champion.classify(texts)) == 4
    assert champion.classify(texts[:3]) == ["fruit", "metal", "color"]
