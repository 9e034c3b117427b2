"""Self-contained HTML for the Decks: static PNG plots inlined as base64, no scripts, no network."""

from __future__ import annotations

import base64
import html
import io
from typing import Sequence

PAGE_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:16px;color:#222}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    "h2{margin-top:24px}"
)


def page(title: str, sections: Sequence[str]) -> str:
    """A standalone HTML page, the same content the Deck shows."""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{PAGE_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>"
    )


def section(heading: str, body: str, *, section_id: str) -> str:
    return f"<section id='{section_id}'><h2>{html.escape(heading)}</h2>{body}</section>"


def table(rows: Sequence[tuple[str, object]]) -> str:
    cells = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in rows
    )
    return f"<table>{cells}</table>"


def _fmt(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return f"<img alt='plot' src='data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}'/>"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def training_curves(history: Sequence[dict[str, float]], step_log: Sequence[dict[str, float]]) -> str:
    """Loss, accuracy, LR and throughput against optimizer steps."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.6))
    steps = [r["step"] for r in step_log]
    epoch_steps = [r["global_step"] for r in history]
    axes[0].plot(steps, [r["train_loss"] for r in step_log], label="train (logged steps)")
    axes[0].plot(epoch_steps, [r["val_loss"] for r in history], "o-", label="val (epoch end)")
    axes[0].set_title("loss")
    axes[1].plot(steps, [r["train_accuracy"] for r in step_log], label="train")
    axes[1].plot(epoch_steps, [r["val_accuracy"] for r in history], "o-", label="val")
    axes[1].set_title("accuracy")
    axes[2].plot(steps, [r["lr"] for r in step_log])
    axes[2].set_title("learning rate")
    axes[3].plot(steps, [r["samples_per_s"] for r in step_log])
    axes[3].set_title("throughput (samples/s)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend()
    return _png(fig)


def confusion_matrix(confusion: Sequence[Sequence[int]], classes: Sequence[str]) -> str:
    plt = _pyplot()
    n = len(classes)
    size = min(12, 2 + 0.45 * n)
    fig, ax = plt.subplots(figsize=(size, size))
    image = ax.imshow(confusion, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046)
    if n <= 30:
        ax.set_xticks(range(n), labels=classes, rotation=90)
        ax.set_yticks(range(n), labels=classes)
        for i in range(n):
            for j in range(n):
                if confusion[i][j]:
                    ax.text(j, i, str(confusion[i][j]), ha="center", va="center", fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("confusion matrix (test)")
    return _png(fig)


def metric_vs_epochs(curves: dict[int, tuple[Sequence[int], Sequence[float]]], *, metric: str, best: int) -> str:
    """One line per trial (its metric at each scored epoch), the best trial highlighted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for trial_id, (epochs, scores) in sorted(curves.items()):
        if not scores:
            continue
        highlight = trial_id == best
        ax.plot(epochs, scores, "o-", linewidth=2.5 if highlight else 1, alpha=1 if highlight else 0.6,
                label=f"trial {trial_id}" + (" (best)" if highlight else ""))
    ax.set_xlabel("epochs trained")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _png(fig)
