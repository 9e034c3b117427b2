"""Self-contained HTML for the Decks: static PNG plots inlined as base64, no scripts, no fonts, no network.

The tasks build their reports only through the ``*_sections`` functions here, so a test can build the same
pages from hand-made records without training anything.
"""

from __future__ import annotations

import base64
import html
import io
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from training_core.redact import redact

if TYPE_CHECKING:
    import pandas as pd

    from tasks.tuning import Trial
    from training_core.records import EpochRecord, StepRecord
    from training_core.tuning import TuningConfig

STYLE = (
    ".report{font-family:system-ui,sans-serif;color:#222;max-width:1100px}"
    ".report section{margin:0 0 28px}.report h2{margin:0 0 8px;font-size:1.25em}"
    ".report p.note{color:#555;margin:4px 0 8px}"
    # Wide tables (a trial per row, a column per param) scroll inside the page instead of widening it.
    ".report table{border-collapse:collapse;display:block;max-width:100%;overflow-x:auto}"
    ".report td,.report th{border:1px solid #ccc;padding:4px 10px;text-align:right}"
    ".report th{background:#f4f4f4}.report th.key{text-align:left}"
    ".report img{max-width:100%;height:auto}"
    ".report .tiles{display:flex;flex-wrap:wrap;gap:12px}"
    ".report .tile{border:1px solid #ccc;border-radius:6px;padding:10px 16px;min-width:130px}"
    ".report .tile b{display:block;font-size:1.6em}.report .tile span{color:#555}"
)


def page(title: str, sections: Sequence[str]) -> str:
    """A standalone HTML page with ``sections``: the same content the Deck shows, readable without Flyte. URL
    credentials anywhere in it are redacted."""
    return redact(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>body{{margin:16px}}{STYLE}</style></head><body><div class='report'>"
        f"<h1>{html.escape(title)}</h1>{''.join(sections)}</div></body></html>"
    )


def deck(sections: Sequence[str], *, marker: str = "") -> str:
    """The Deck body: ``sections`` with their style, inside flytekit's own page template.

    ``marker`` goes into a ``data-report`` attribute, so the deck.html flytekit writes can be found again
    by content (``tasks.artifacts.local_deck_path``). URL credentials anywhere in it, the marker's included, are
    redacted.
    """
    attribute = html.escape(marker, quote=True)
    return redact(f"<div class='report' data-report='{attribute}'><style>{STYLE}</style>{''.join(sections)}</div>")


def section(heading: str, body: str, *, section_id: str) -> str:
    return f"<section id='{section_id}'><h2>{html.escape(heading)}</h2>{body}</section>"


def note(text: str) -> str:
    return f"<p class='note'>{html.escape(text)}</p>"


def table(rows: Sequence[tuple[str, object]]) -> str:
    """A two-column table: one name and one value per row."""
    cells = "".join(f"<tr><th class='key'>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def grid(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A table with a header row; the first column names the row."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + f"<th class='key'>{html.escape(_fmt(row[0]))}</th>"
        + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row[1:])
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def tiles(items: Sequence[tuple[str, str]]) -> str:
    """Headline figures, large: (label, formatted value) pairs."""
    return (
        "<div class='tiles'>"
        + "".join(
            f"<div class='tile'><b>{html.escape(value)}</b><span>{html.escape(label)}</span></div>"
            for label, value in items
        )
        + "</div>"
    )


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


def _percent_axis(ax) -> None:
    """Plot ratios (0-1) and label the axis in percent."""
    from matplotlib.ticker import PercentFormatter

    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))


def _axes(title: str, *, xlabel: str, ylabel: str, ncols: int = 1):
    plt = _pyplot()
    fig, axes = plt.subplots(1, ncols, figsize=(7.5 * ncols if ncols > 1 else 8, 3.4), squeeze=False)
    for ax in axes[0]:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_title(title)
    return fig, list(axes[0])


# --- training -------------------------------------------------------------------------------------------------


def training_sections(
    *,
    summary: Sequence[tuple[str, object]],
    history: Sequence[EpochRecord],
    step_log: Sequence[StepRecord],
    telemetry: Mapping[str, Any],
) -> list[str]:
    """The training report: summary, loss, accuracy, LR, throughput, GPU (or host CPU) timeline, cost.

    :param summary: (name, value) rows for the summary table.
    :param history: One record per epoch (``global_step``, ``train_loss``, ``val_loss``, ``val_accuracy``...).
    :param step_log: One record per logged step window (``step``, ``train_loss``, ``train_accuracy``, ``lr``,
        ``samples_per_s`` and, when recorded, ``elapsed_s`` since training started).
    :param telemetry: The final checkpoint's telemetry: ``samples`` (``elapsed_s``, ``cpu_utilization`` 0-1,
        ``memory_used_bytes``, ``gpu_utilization`` {gpu: 0-1}, ``gpu_memory_used_bytes`` {gpu: bytes}) and
        ``cost`` (``gpu_hours``, ``cpu_hours``, ``gpu_hour_usd``, ``cpu_hour_usd``, ``cost_usd``); either may
        be missing.
    """
    samples = list(telemetry.get("samples") or [])
    return [
        section("Summary", table(summary), section_id="summary"),
        section(
            "Loss", _epoch_and_step_curve(history, step_log, "loss", ylabel="cross-entropy loss"), section_id="loss"
        ),
        section(
            "Accuracy", _epoch_and_step_curve(history, step_log, "accuracy", ylabel="accuracy"), section_id="accuracy"
        ),
        section("Learning rate", _learning_rate(step_log), section_id="learning-rate"),
        section("Throughput", _throughput(step_log), section_id="throughput"),
        section("GPU utilisation", _gpu_timeline(samples), section_id="gpu"),
        section("Cost", _cost(telemetry.get("cost") or {}), section_id="cost"),
        section("Goodput", _goodput(telemetry.get("goodput"), telemetry.get("cost") or {}), section_id="goodput"),
        section("Ranks", _ranks(telemetry.get("ranks") or []), section_id="ranks"),
    ]


def _epoch_and_step_curve(history, step_log, metric: str, *, ylabel: str) -> str:
    """Train ``metric`` per logged step window and validation ``metric`` at each epoch end."""
    train = [(r.step, getattr(r, f"train_{metric}")) for r in step_log]
    val = [(r.global_step, getattr(r, f"val_{metric}")) for r in history]
    if not train and not val:
        return note(f"No {metric} was recorded.")
    fig, (ax,) = _axes(f"{metric}: train and validation", xlabel="optimizer step", ylabel=ylabel)
    if train:
        ax.plot(*zip(*train), label="train (logged step windows)")
    if val:
        ax.plot(*zip(*val), "o-", label="validation (epoch end)")
    if metric == "accuracy":
        _percent_axis(ax)
    ax.legend()
    return _png(fig)


def _learning_rate(step_log) -> str:
    points = [(r.step, r.lr) for r in step_log]
    if not points:
        return note("No learning rate was recorded.")
    fig, (ax,) = _axes("learning rate schedule", xlabel="optimizer step", ylabel="learning rate")
    ax.plot(*zip(*points))
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return _png(fig)


def _throughput(step_log) -> str:
    """Samples/s against elapsed seconds; against the step when the records have no ``elapsed_s`` (older runs)."""
    records = list(step_log)
    if not records:
        return note("No throughput was recorded.")
    timed = all(r.elapsed_s > 0 for r in records)
    xlabel = "elapsed time (s)" if timed else "optimizer step"
    fig, (ax,) = _axes("throughput, all workers", xlabel=xlabel, ylabel="samples/s")
    ax.plot([r.elapsed_s if timed else r.step for r in records], [r.samples_per_s for r in records], "-")
    ax.set_ylim(bottom=0)
    return _png(fig)


def _gpu_timeline(samples: Sequence[Mapping[str, Any]]) -> str:
    """Per-GPU utilisation and memory over time; the host's CPU and memory instead when there was no GPU."""
    if not samples:
        return note("No GPU was present, or no telemetry was recorded for this run: there is no utilisation timeline.")
    gpus = sorted({gpu for s in samples for gpu in (s.get("gpu_utilization") or {})}, key=_gpu_order)
    elapsed = [s["elapsed_s"] for s in samples]
    if gpus:
        fig, (util_ax, mem_ax) = _axes("GPU utilisation", xlabel="elapsed time (s)", ylabel="utilisation", ncols=2)
        for gpu in gpus:
            util_ax.plot(elapsed, [(s.get("gpu_utilization") or {}).get(gpu) for s in samples], label=f"GPU {gpu}")
            mem_ax.plot(
                elapsed, [_gib((s.get("gpu_memory_used_bytes") or {}).get(gpu)) for s in samples], label=f"GPU {gpu}"
            )
        mem_ax.set_title("GPU memory used")
        mem_ax.set_ylabel("memory used (GiB)")
        for ax in (util_ax, mem_ax):
            ax.legend(fontsize=8)
        text = ""
    else:
        fig, (util_ax, mem_ax) = _axes("host CPU utilisation", xlabel="elapsed time (s)", ylabel="utilisation", ncols=2)
        util_ax.plot(elapsed, [s.get("cpu_utilization") for s in samples], color="tab:orange")
        mem_ax.plot(elapsed, [_gib(s.get("memory_used_bytes")) for s in samples], color="tab:orange")
        mem_ax.set_title("host memory used")
        mem_ax.set_ylabel("memory used (GiB)")
        text = note(
            "No GPU was present on this run: it trained on CPU. The host's CPU and memory use are shown instead."
        )
    util_ax.set_ylim(0, 1.05)
    _percent_axis(util_ax)
    mem_ax.set_ylim(bottom=0)
    return text + _png(fig)


def _gpu_order(gpu: object) -> tuple[int, str]:
    """GPU 2 before GPU 10; ids that are not indices (a UUID) after them."""
    text = str(gpu)
    return (int(text), "") if text.isdigit() else (10**9, text)


def _gib(value_bytes: float | None) -> float | None:
    return None if value_bytes is None else value_bytes / 2**30


def _cost(cost: Mapping[str, float]) -> str:
    if not cost:
        return note("No cost was recorded for this run.")
    gpu_hours, cpu_hours = float(cost.get("gpu_hours", 0.0)), float(cost.get("cpu_hours", 0.0))
    gpu_price, cpu_price = float(cost.get("gpu_hour_usd", 0.0)), float(cost.get("cpu_hour_usd", 0.0))
    total = float(cost.get("cost_usd", gpu_hours * gpu_price + cpu_hours * cpu_price))
    return grid(
        ["resource", "hours", "price (USD per hour)", "cost (USD)"],
        [
            ("GPU", f"{gpu_hours:.4f}", f"{gpu_price:.2f}", f"{gpu_hours * gpu_price:.4f}"),
            ("CPU", f"{cpu_hours:.4f}", f"{cpu_price:.2f}", f"{cpu_hours * cpu_price:.4f}"),
            ("total", "", "", f"{total:.4f}"),
            *_preemption_rows(cost, gpu_price, cpu_price),
        ],
    ) + note(
        "Hours are summed over all workers and attempts; prices come from observability.gpu_hour_usd and cpu_hour_usd."
        " Lost to preemptions: of those hours, the ones each attempt resumed after a preemption spent before its"
        " first step (start-up and restore); the steps before the preemption's checkpoint are kept."
    )


def _preemption_rows(cost: Mapping[str, float], gpu_price: float, cpu_price: float) -> list[tuple[str, ...]]:
    """The cost table's rows of what preemptions cost, when the run had any (checkpoints written before the split
    have no such figures)."""
    gpu_hours, cpu_hours = float(cost.get("preemption_gpu_hours", 0.0)), float(cost.get("preemption_cpu_hours", 0.0))
    if not (gpu_hours or cpu_hours):
        return []
    total = float(cost.get("preemption_cost_usd", gpu_hours * gpu_price + cpu_hours * cpu_price))
    return [
        ("GPU lost to preemptions", f"{gpu_hours:.4f}", f"{gpu_price:.2f}", f"{gpu_hours * gpu_price:.4f}"),
        ("CPU lost to preemptions", f"{cpu_hours:.4f}", f"{cpu_price:.2f}", f"{cpu_hours * cpu_price:.4f}"),
        ("lost to preemptions", "", "", f"{total:.4f}"),
    ]


def _goodput(saved: Mapping[str, Any] | None, cost: Mapping[str, float]) -> str:
    """A stacked bar of worker-seconds per attempt by category, and a table with each category's seconds, share
    and cost (its share of the job's cost)."""
    from training_core.telemetry.goodput import CATEGORIES, ExecutionGoodput

    execution = ExecutionGoodput.from_summary(saved)
    if not execution.attempts:
        return note("No goodput was recorded for this run (a checkpoint written before it was).")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.5 * len(execution.attempts)))
    colors = plt.get_cmap("tab10").colors
    for attempt in execution.attempts:
        left = 0.0
        for index, (name, value) in enumerate(zip(CATEGORIES, attempt.seconds.as_list())):
            label = name if attempt is execution.attempts[0] else None
            ax.barh(f"attempt {attempt.index}", value, left=left, color=colors[index % 10], label=label)
            left += value
    ax.set_xlabel("worker-seconds")
    ax.invert_yaxis()
    ax.legend(ncols=5, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.35))
    total_s, cost_usd = execution.seconds.total_s, float(cost.get("cost_usd", 0.0))
    rows = [
        (name, f"{value:.1f}", f"{value / total_s:.1%}" if total_s else "", f"{cost_usd * value / total_s:.4f}")
        for name, value in zip(CATEGORIES, execution.seconds.as_list())
        if total_s and value > 0
    ]
    return (
        tiles([("goodput", f"{execution.goodput:.1%}"), ("attempts", str(len(execution.attempts)))])
        + _png(fig)
        + grid(["category", "worker-seconds", "share", "cost (USD)"], rows)
        + note(
            "Every second of every worker from the first attempt's start to the last checkpoint, by what it went"
            " to; goodput is the productive share. Cost is each category's share of the job's cost."
        )
    )


def _ranks(ranks: Sequence[Mapping[str, Any]]) -> str:
    """Per rank: its seconds over the log windows and how often it was flagged as a straggler."""
    if not ranks:
        return note("No per-rank figures were recorded for this run.")
    rows = [
        (
            r.get("rank", ""),
            r.get("node", ""),
            f"{float(r.get('compute_s', 0.0)):.2f}",
            f"{float(r.get('data_wait_s', 0.0)):.2f}",
            f"{float(r.get('comm_wait_s', 0.0)):.2f}",
            int(r.get("flagged_windows", 0)),
            r.get("cause") or "-",
        )
        for r in ranks
    ]
    header = ["rank", "node", "compute (s)", "data wait (s)", "comm. wait (s)", "straggler windows", "cause"]
    return grid(header, rows) + note(
        "This attempt's seconds over its log windows. A straggler computes (or waits for data) longer than the"
        " other ranks' median by observability.straggler_threshold for observability.straggler_windows windows;"
        " the others then wait for it in the all-reduce."
    )


# --- evaluation -----------------------------------------------------------------------------------------------


def evaluation_sections(result, *, history: Sequence[EpochRecord] = ()) -> list[str]:
    """The evaluation report of a ``training_core.evaluation.EvalReport``: headline metrics (the primary one
    first), the validation curve of the run, and per workload the confusion matrix and per-class
    precision/recall/F1 (classifiers) or greedy continuations of fixed prompts (language models)."""
    metrics = dict(result.metrics)
    primary = metrics.pop(result.primary_metric)
    better = "higher" if result.primary_mode == "max" else "lower"
    items = [(f"{result.primary_metric} ({better} is better)", _metric_text(result.primary_metric, primary))]
    items += [(name, _metric_text(name, value)) for name, value in sorted(metrics.items())]
    per_class = class_metrics(result.confusion) if result.confusion else []
    if per_class:
        items.append(("macro F1", f"{sum(f1 for _, _, f1, _ in per_class) / len(per_class):.4f}"))
    items.append((f"{result.split} samples", str(result.num_samples)))
    sections = [section("Test metrics", tiles(items), section_id="metrics")]
    if history:
        sections.append(
            section("Validation curve", _validation_curve(history, result.primary_metric), section_id="validation")
        )
    if per_class:
        rows = [
            (name, f"{p:.4f}", f"{r:.4f}", f"{f1:.4f}", support)
            for name, (p, r, f1, support) in zip(result.classes, per_class)
        ]
        sections += [
            section("Confusion matrix", confusion_matrix(result.confusion, result.classes), section_id="confusion"),
            section("Per class", grid(["class", "precision", "recall", "F1", "support"], rows), section_id="per-class"),
        ]
    if result.continuations:
        rows = [(c.prompt, c.text) for c in result.continuations]
        sections.append(
            section(
                "Greedy continuations",
                note("The model's most likely next tokens after each fixed prompt (greedy decoding).")
                + grid(["prompt", "continuation"], rows),
                section_id="continuations",
            )
        )
    return sections


def _metric_text(name: str, value: float) -> str:
    return f"{value:.2%}" if "accuracy" in name else f"{value:.4f}"


def _validation_curve(history: Sequence[EpochRecord], primary_metric: str) -> str:
    """Validation loss per epoch, and the primary metric when the records hold it (accuracy, perplexity)."""
    name = primary_metric if hasattr(history[0], f"val_{primary_metric}") else "loss"
    fig, (ax,) = _axes(f"validation {name} per epoch", xlabel="optimizer step", ylabel=name)
    ax.plot([r.global_step for r in history], [getattr(r, f"val_{name}") for r in history], "o-")
    if "accuracy" in name:
        _percent_axis(ax)
    return _png(fig)


def class_metrics(confusion: Sequence[Sequence[int]]) -> list[tuple[float, float, float, int]]:
    """(precision, recall, F1, support) per class of ``confusion[true][predicted]``; 0 where undefined."""
    n = len(confusion)
    out = []
    for c in range(n):
        hits = confusion[c][c]
        predicted = sum(confusion[t][c] for t in range(n))
        support = sum(confusion[c])
        precision = hits / predicted if predicted else 0.0
        recall = hits / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        out.append((precision, recall, f1, support))
    return out


def confusion_matrix(confusion: Sequence[Sequence[int]], classes: Sequence[str]) -> str:
    plt = _pyplot()
    n = len(classes)
    size = min(12, 3 + 0.45 * n)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(confusion, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046, label="test samples")
    if n <= 30:
        ax.set_xticks(range(n), labels=classes, rotation=90 if max(map(len, classes), default=0) > 3 else 0)
        ax.set_yticks(range(n), labels=classes)
        darkest = max((v for row in confusion for v in row), default=0)
        for i in range(n):
            for j in range(n):
                if confusion[i][j]:
                    # White on the dark cells, black on the light ones, so every count stays readable.
                    color = "white" if confusion[i][j] > darkest / 2 else "black"
                    ax.text(j, i, str(confusion[i][j]), ha="center", va="center", fontsize=8, color=color)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title("confusion matrix (counts)")
    return _png(fig)


# --- tuning ---------------------------------------------------------------------------------------------------


def tuning_sections(
    config: TuningConfig, trials: Sequence[Trial], *, best: Trial, frame: pd.DataFrame, parent_run_id: str
) -> list[str]:
    """The tuning report: the best trial and its params, every trial's metric against epochs, the trial table.

    :param best: The trial the search picked (``tasks.tuning.best_trial``).
    :param frame: The trial table (``tasks.tuning.trial_table``), one row per trial.
    """
    summary = table(
        [
            ("algorithm", f"{config.algorithm} ({config.strategy})"),
            ("trials", len(trials)),
            (f"best {config.metric}", best.scores[-1]),
            ("best trial", best.trial_id),
            *[(path, value) for path, value in best.params.items()],
            ("epochs used (all trials)", int(frame["epochs_used"].sum())),
            ("epochs if every trial ran in full", len(trials) * config.base.loop.epochs),
            ("MLflow parent run", parent_run_id),
        ]
    )
    return [
        section("Best trial", summary, section_id="best"),
        section(
            f"{config.metric} against epochs",
            metric_vs_epochs(
                {t.trial_id: (t.score_epochs, t.scores) for t in trials}, metric=config.metric, best=best.trial_id
            ),
            section_id="curves",
        ),
        section(
            "Trials", frame.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep=""), section_id="trials"
        ),
    ]


def metric_vs_epochs(curves: dict[int, tuple[Sequence[int], Sequence[float]]], *, metric: str, best: int) -> str:
    """One line per trial (its metric at each scored epoch), the best trial highlighted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for trial_id, (epochs, scores) in sorted(curves.items()):
        if not scores:
            continue
        highlight = trial_id == best
        ax.plot(
            epochs,
            scores,
            "o-",
            linewidth=2.5 if highlight else 1,
            alpha=1 if highlight else 0.6,
            label=f"trial {trial_id}" + (" (best)" if highlight else ""),
        )
    from matplotlib.ticker import MaxNLocator

    ax.set_title(f"{metric} of each trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epochs trained")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _png(fig)


# --- scaling benchmark ----------------------------------------------------------------------------------------

# Shown with the figures: what was measured, so nobody compares them with a different definition.
SCALING_METHOD_NOTE = (
    "Steady state: the first steps of each run and epoch boundaries (validation, checkpoints) are excluded. "
    "Throughput is samples per second over all workers; efficiency_n = (throughput_n / n) / (throughput_b / b) "
    "for the smallest worker count b; parity = Ray Train throughput / plain torch.distributed throughput at the "
    "same worker count. The all-reduce share is the time DDP's gradient all-reduces were in flight (a comm hook) "
    "over the step time, on rank 0. Ray starts its workers at nice 15 (RAY_worker_niceness): on a machine with "
    "other busy processes that alone lowers Ray's throughput against the plain launcher, which runs at nice 0."
)


def scaling_sections(efficiency: pd.DataFrame) -> list[str]:
    """The scaling benchmark's report of an ``efficiency_table`` (``training_core.scaling_benchmark``): how it
    was measured, the table, throughput and efficiency."""
    return [
        section("How it was measured", f"<p>{html.escape(SCALING_METHOD_NOTE)}</p>", section_id="method"),
        section(
            "Results",
            efficiency.to_html(index=False, float_format=lambda v: f"{v:.4f}", border=0),
            section_id="results",
        ),
        section("Throughput and efficiency", _scaling_plots(efficiency), section_id="plots"),
    ]


def _scaling_plots(efficiency: pd.DataFrame) -> str:
    """Per model: throughput against workers (with linear scaling from the smallest count), and efficiency."""
    plt = _pyplot()
    fig, (throughput_ax, efficiency_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for model, rows in efficiency.groupby("model", sort=True):
        counts = rows["num_workers"].tolist()
        base_count, base_ray = counts[0], rows["ray_samples_per_s"].iloc[0]
        throughput_ax.plot(counts, rows["ray_samples_per_s"], "o-", label=f"{model} Ray Train")
        throughput_ax.plot(counts, rows["torch_samples_per_s"], "s--", label=f"{model} plain torch")
        throughput_ax.plot(
            counts, [base_ray * n / base_count for n in counts], ":", color="gray", label=f"{model} linear"
        )
        efficiency_ax.plot(counts, rows["ray_efficiency"], "o-", label=f"{model} Ray Train")
        efficiency_ax.plot(counts, rows["torch_efficiency"], "s--", label=f"{model} plain torch")
    throughput_ax.set_title("throughput, all workers")
    throughput_ax.set_ylabel("samples/s")
    efficiency_ax.set_title("scaling efficiency")
    efficiency_ax.set_ylabel("efficiency (1 = linear)")
    efficiency_ax.axhline(1.0, color="gray", linestyle=":")
    efficiency_ax.set_ylim(0, 1.1)
    for ax in (throughput_ax, efficiency_ax):
        ax.set_xlabel("workers")
        ax.set_xticks(sorted(efficiency["num_workers"].unique()))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _png(fig)
