"""The Decks as people see them: reports built from hand-made records (no training), rendered by Debian's
headless Chromium to a PNG, and checked for their sections, for pixels that are not blank, and for no network."""

from __future__ import annotations

import base64
import io
import math
import os
import random
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from training_core.records import EpochRecord, StepRecord

CHROMIUM = shutil.which("chromium")
# `make test` installs Debian's chromium when it is missing: without it these tests fail, they do not skip.
needs_chromium = pytest.mark.usefixtures("chromium_installed")


@pytest.fixture
def chromium_installed() -> None:
    if CHROMIUM is None:
        pytest.fail("Debian's chromium is not installed: run `make system-packages` (make test does)", pytrace=False)


WINDOW_WIDTH_PX = 1200
STEPS_PER_EPOCH, EPOCHS, LOG_EVERY_STEPS = 19, 5, 5
TRAINING_SECTIONS = ["summary", "loss", "accuracy", "learning-rate", "throughput", "gpu", "cost", "goodput", "ranks"]
EVALUATION_SECTIONS = ["metrics", "confusion", "per-class"]
DIGITS = [str(d) for d in range(10)]


# --- realistic records, shaped like the ones training_core writes ------------------------------------------


def _step_log(*, timed: bool = True) -> list[dict[str, float]]:
    """One record per logged window of a 2-worker digits run, shaped like ``training_core.train.loop``'s."""
    total = STEPS_PER_EPOCH * EPOCHS
    records = []
    for step in range(LOG_EVERY_STEPS, total + 1, LOG_EVERY_STEPS):
        progress = step / total
        record = {
            "step": float(step),
            "train_loss": 2.3 * math.exp(-4 * progress) + 0.04,
            "train_accuracy": 1 - 0.9 * math.exp(-5 * progress),
            "lr": 0.01 * 0.5 * (1 + math.cos(math.pi * progress)),
            "grad_norm": 3 * math.exp(-2 * progress),
            "samples_per_s": 880 + 60 * math.sin(step / 7),
            "step_time_s": 0.073,
            "data_wait_s": 0.002,
            "allreduce_fraction": 0.21,
            "epoch": float(step // STEPS_PER_EPOCH),
        }
        if timed:
            record["elapsed_s"] = step * 0.073 + 1.5 * (step // STEPS_PER_EPOCH)
        records.append(record)
    return records


def _history() -> list[dict[str, float]]:
    return [
        {
            "epoch": float(e),
            "global_step": float(e * STEPS_PER_EPOCH),
            "train_loss": 2.3 * math.exp(-0.8 * e),
            "train_accuracy": 1 - 0.9 * math.exp(-e),
            "val_loss": 2.2 * math.exp(-0.75 * e) + 0.06,
            "val_accuracy": 1 - 0.85 * math.exp(-e) - 0.01,
            "lr": 0.01 * 0.5 * (1 + math.cos(math.pi * e / EPOCHS)),
            "samples_per_s": 870.0,
            "steady_samples_per_s": 905.0,
        }
        for e in range(1, EPOCHS + 1)
    ]


def _telemetry(*, num_gpus: int) -> dict:
    """``CheckpointMeta.telemetry``: host (and GPU) samples every 2 s, and the job's cost."""
    samples = []
    for i in range(12):
        elapsed_s = 2.0 * i
        sample = {
            "elapsed_s": elapsed_s,
            "cpu_utilization": min(1.0, 0.35 + 0.05 * i),
            "memory_used_bytes": (6 + 0.1 * i) * 2**30,
        }
        if num_gpus:
            sample["gpu_utilization"] = {str(g): min(1.0, 0.2 + 0.07 * i + 0.05 * g) for g in range(num_gpus)}
            sample["gpu_memory_used_bytes"] = {str(g): (2 + 0.2 * i + g) * 2**30 for g in range(num_gpus)}
        samples.append(sample)
    hours = 24.0 / 3600
    gpu_hours, cpu_hours = num_gpus * hours, 4 * hours
    return {
        "samples": samples,
        "cost": {
            "gpu_hours": gpu_hours,
            "cpu_hours": cpu_hours,
            "gpu_hour_usd": 2.5,
            "cpu_hour_usd": 0.05,
            "cost_usd": gpu_hours * 2.5 + cpu_hours * 0.05,
        },
        "goodput": {"attempts": [_attempt(0, "failed", productive=30.0, recomputed=6.0), _attempt(1, "finished")]},
        "ranks": [
            {"rank": 0, "node": "node-a", "compute_s": 10.0, "data_wait_s": 0.5, "comm_wait_s": 4.0},
            {"rank": 1, "node": "node-b", "compute_s": 14.0, "data_wait_s": 0.5, "comm_wait_s": 0.2,
             "flagged_windows": 7, "cause": "compute"},
        ],
    }  # fmt: skip


def _attempt(index: int, outcome: str, *, productive: float = 20.0, recomputed: float = 0.0) -> dict:
    """One attempt of ``meta.telemetry["goodput"]`` on 2 workers: 48 worker-seconds in all."""
    seconds = {"productive": productive, "startup": 4.0, "checkpoint": 2.0, "recomputed": recomputed}
    seconds["communication"] = 48.0 - sum(seconds.values())
    start = 1000.0 + 30.0 * index
    return {"index": index, "num_workers": 2, "start_unix": start, "end_unix": start + 24.0, "outcome": outcome,
            "seconds": seconds}  # fmt: skip


def _training_sections(*, num_gpus: int, timed: bool = True, telemetry: dict | None = None) -> list[str]:
    from tasks import reports

    summary = [
        ("model", "resnet18"),
        ("epochs", EPOCHS),
        ("optimizer steps", STEPS_PER_EPOCH * EPOCHS),
        ("workers", 2),
        ("final val accuracy", 0.9712),
        ("throughput (samples/s)", 905.0),
    ]
    return reports.training_sections(
        summary=summary,
        history=[EpochRecord.from_dict(r) for r in _history()],
        step_log=[StepRecord.from_dict(r) for r in _step_log(timed=timed)],
        telemetry=_telemetry(num_gpus=num_gpus) if telemetry is None else telemetry,
    )


def _eval_report():
    from training_core.evaluation import EvalReport

    rng = random.Random(0)
    confusion = [[0] * 10 for _ in range(10)]
    for true in range(10):
        for _ in range(36 if true != 9 else 35):
            predicted = true if rng.random() < 0.96 else rng.randrange(10)
            confusion[true][predicted] += 1
    correct = sum(confusion[c][c] for c in range(10))
    return EvalReport(
        split="test",
        num_samples=359,
        workload="image_classification",
        metrics={"loss": 0.121, "accuracy": correct / 359, "top5_accuracy": 0.9972},
        primary_metric="accuracy",
        primary_mode="max",
        confusion=confusion,
        classes=DIGITS,
    )


def _tuning_sections() -> list[str]:
    from tasks.reports import tuning_sections
    from tasks.tuning import Trial, best_trial, trial_table
    from training_core.tuning import TuningConfig, sample

    config = TuningConfig()
    rng = random.Random(1)
    trials = []
    # ASHA on 6 trials: everyone scored at epoch 1, the best 3 go on to 2, the best one to 4.
    for trial_id, (reach, final) in enumerate([(1, 0.61), (2, 0.83), (4, 0.97), (1, 0.55), (2, 0.88), (1, 0.7)]):
        epochs = [e for e in (1, 2, 4) if e <= reach]
        scores = [final - 0.08 * (len(epochs) - 1 - i) for i in range(len(epochs))]
        trials.append(
            Trial(
                trial_id=trial_id,
                params=sample(config.search_space, rng),
                status="finished",
                epochs_trained=reach,
                epochs_used=reach,
                scores=scores,
                score_epochs=epochs,
            )
        )
    return tuning_sections(
        config,
        trials,
        best=best_trial(config, trials),
        frame=trial_table(config, trials),
        parent_run_id="0123456789abcdef",
    )


def _scaling_sections() -> list[str]:
    from tasks.reports import scaling_sections
    from training_core.scaling_benchmark import ScalingPoint, efficiency_table

    measured = {("ray", 1): 520.0, ("ray", 2): 800.0, ("torch", 1): 540.0, ("torch", 2): 990.0}
    points = [
        ScalingPoint(
            model="small_cnn",
            num_workers=n,
            launcher=launcher,
            samples_per_s=v,
            step_time_p50_s=64 * n / v,
            step_time_p95_s=1.2 * 64 * n / v,
            allreduce_fraction=0.0 if n == 1 else 0.18,
        )
        for (launcher, n), v in measured.items()
    ]
    return scaling_sections(efficiency_table(points))


# --- looking at the HTML and at Chromium's rendering -------------------------------------------------------


class _Page(HTMLParser):
    """Section ids, and every src/href, of one page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.section_ids: list[str] = []
        self.links: list[str] = []
        self.images: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "section":
            self.section_ids.append(values.get("id") or "")
        if tag == "img":
            self.images.append(values.get("src") or "")
        self.links += [v or "" for k, v in attrs if k in ("src", "href")]


def _write_page(tmp_path: Path, title: str, sections: list[str]) -> Path:
    from tasks import reports

    path = tmp_path / f"{title.lower().replace(' ', '_')}.html"
    path.write_text(reports.page(title, sections), encoding="utf-8")
    return path


def _chromium(tmp_path: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    """Debian's headless Chromium on ``page``: its own profile and HOME under the test's directory, no network."""
    home = tmp_path / "chromium-home"
    home.mkdir(exist_ok=True)
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        *args,
        page.as_uri(),
    ]
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _screenshot(tmp_path: Path, page: Path, *, height_px: int) -> Path:
    png = page.with_suffix(".png")
    _chromium(tmp_path, page, f"--screenshot={png}", f"--window-size={WINDOW_WIDTH_PX},{height_px}")
    return png


def _assert_not_blank(png: Path, *, size: tuple[int, int]) -> None:
    import numpy as np
    from PIL import Image

    assert png.is_file(), f"Chromium wrote no screenshot at {png}"
    with Image.open(png) as image:
        assert image.size == size
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20)
        pixels = np.asarray(rgb, dtype=np.int32)
    non_white = float((pixels.sum(axis=2) < 3 * 245).mean())
    # Text alone gives a few colours and ~1-2 % ink; plots with lines, fills and anti-aliasing give far more.
    assert colours is not None and len(colours) > 200, f"{png.name}: only {len(colours or [])} colours"
    assert non_white > 0.05, f"{png.name}: {non_white:.1%} of the pixels are not white"


def _assert_plots_are_pngs(page: _Page, *, count: int) -> None:
    from PIL import Image

    prefix = "data:image/png;base64,"
    assert len(page.images) == count and all(src.startswith(prefix) for src in page.images)
    for src in page.images:
        with Image.open(io.BytesIO(base64.b64decode(src[len(prefix) :]))) as image:
            assert image.format == "PNG" and image.width > 300 and image.height > 150


def _assert_rendered(
    tmp_path: Path, title: str, sections: list[str], *, expected_ids: list[str], plots: int, height_px: int
) -> _Page:
    """Write the page, check its sections and plots, and have Chromium show it: a DOM with the same sections,
    and a screenshot of the requested size that is not blank."""
    path = _write_page(tmp_path, title, sections)
    page = _Page(path.read_text(encoding="utf-8"))
    assert page.section_ids == expected_ids
    _assert_plots_are_pngs(page, count=plots)
    dom = _Page(_chromium(tmp_path, path, "--dump-dom").stdout)
    assert dom.section_ids == expected_ids, "Chromium's DOM lacks sections of the page"
    _assert_not_blank(_screenshot(tmp_path, path, height_px=height_px), size=(WINDOW_WIDTH_PX, height_px))
    return page


# --- tests -------------------------------------------------------------------------------------------------


@needs_chromium
def test_training_report_with_gpus_renders_in_chromium_with_every_section_and_a_non_blank_picture(tmp_path):
    sections = _training_sections(num_gpus=2)
    _assert_rendered(tmp_path, "Training report", sections, expected_ids=TRAINING_SECTIONS, plots=6, height_px=3200)
    gpu_section = sections[TRAINING_SECTIONS.index("gpu")]
    assert "No GPU" not in gpu_section
    cost_section = sections[TRAINING_SECTIONS.index("cost")]
    for figure in ("0.0133", "0.0267", "2.50", "0.05", "0.0347"):  # GPU-h, CPU-h, prices, total USD
        assert figure in cost_section, figure
    # Goodput: 50 of 96 worker-seconds productive; recomputed 6 s is 6.2 % of them and of the 0.0347 USD.
    goodput_section = sections[TRAINING_SECTIONS.index("goodput")]
    for figure in ("52.1%", "attempt", "recomputed", "6.0", "6.2%", "0.0022"):
        assert figure in goodput_section, figure
    ranks_section = sections[TRAINING_SECTIONS.index("ranks")]
    assert "node-b" in ranks_section and "compute" in ranks_section and "14.00" in ranks_section


@needs_chromium
def test_evaluation_report_renders_in_chromium_with_headline_metrics_confusion_heatmap_and_per_class_table(tmp_path):
    result = _eval_report()
    from tasks import reports

    sections = reports.evaluation_sections(result)
    _assert_rendered(tmp_path, "Evaluation report", sections, expected_ids=EVALUATION_SECTIONS, plots=1, height_px=1500)
    assert f"{result.primary:.2%}" in sections[0] and "359" in sections[0]
    assert f"{result.loss:.4f}" in sections[0] and f"{result.metrics['top5_accuracy']:.2%}" in sections[0]
    per_class = sections[EVALUATION_SECTIONS.index("per-class")]
    assert per_class.count("<tr>") == 1 + len(DIGITS)


@needs_chromium
def test_tuning_and_scaling_reports_render_in_chromium_with_their_tables_and_plots(tmp_path):
    _assert_rendered(
        tmp_path,
        "Tuning report",
        _tuning_sections(),
        expected_ids=["best", "curves", "trials"],
        plots=1,
        height_px=1100,
    )
    _assert_rendered(
        tmp_path,
        "Scaling report",
        _scaling_sections(),
        expected_ids=["method", "results", "plots"],
        plots=1,
        height_px=900,
    )


def test_without_gpu_samples_the_training_report_says_no_gpu_was_present_and_plots_host_cpu_instead():
    gpu_section = _training_sections(num_gpus=0)[TRAINING_SECTIONS.index("gpu")]
    assert "No GPU was present on this run" in gpu_section
    assert gpu_section.count("<img") == 1  # the host CPU and memory timeline


def test_the_cost_section_splits_out_the_hours_lost_to_preemptions_when_there_were_any():
    telemetry = _telemetry(num_gpus=2)
    without = _training_sections(num_gpus=2, telemetry=telemetry)[TRAINING_SECTIONS.index("cost")]
    assert "lost to preemptions</th>" not in without  # a run that was never preempted gets no such rows
    cost = {**telemetry["cost"], "preemption_gpu_hours": 0.002, "preemption_cpu_hours": 0.004}
    cost["preemption_cost_usd"] = 0.002 * 2.5 + 0.004 * 0.05
    section = _training_sections(num_gpus=2, telemetry={**telemetry, "cost": cost})[TRAINING_SECTIONS.index("cost")]
    rows = {
        m.group(1): re.findall(r"<td>([^<]*)</td>", m.group(2))
        for m in re.finditer(r"<tr><th class='key'>([^<]+)</th>(.*?)</tr>", section)
    }
    assert rows["GPU lost to preemptions"] == ["0.0020", "2.50", "0.0050"]
    assert rows["CPU lost to preemptions"] == ["0.0040", "0.05", "0.0002"]
    assert rows["lost to preemptions"][-1] == "0.0052"
    assert rows["total"][-1] == "0.0347"  # the lost hours are part of the total, not added to it


def test_a_run_without_telemetry_or_elapsed_time_still_gets_every_section_with_curves():
    sections = _training_sections(num_gpus=0, timed=False, telemetry={})
    page = _Page("".join(sections))
    assert page.section_ids == TRAINING_SECTIONS
    assert len(page.images) == 4  # loss, accuracy, LR, throughput against the step axis
    assert "No goodput was recorded" in sections[TRAINING_SECTIONS.index("goodput")]
    assert "no telemetry was recorded" in sections[TRAINING_SECTIONS.index("gpu")]
    assert "No cost was recorded" in sections[TRAINING_SECTIONS.index("cost")]


def test_no_report_or_deck_fetches_anything_from_the_network():
    from tasks import reports

    bodies = {
        "training": _training_sections(num_gpus=1),
        "evaluation": reports.evaluation_sections(_eval_report()),
        "tuning": _tuning_sections(),
        "scaling": _scaling_sections(),
    }
    for name, sections in bodies.items():
        for html_text in (reports.page(name, sections), reports.deck(sections, marker="/raw/abc/report.html")):
            page = _Page(html_text)
            assert page.links, f"{name}: no src/href at all, so this check checked nothing"
            remote = [link for link in page.links if not link.startswith("data:")]
            assert remote == [], f"{name} references {remote}"
            assert "http://" not in html_text and "https://" not in html_text, name


def test_per_class_precision_recall_and_f1_follow_from_the_confusion_matrix():
    from tasks.reports import class_metrics

    # true 0: 8 right, 2 taken for 1; true 1: 5 right; class 2 never occurs and is never predicted.
    (p0, r0, f0, n0), (p1, r1, f1, n1), (p2, r2, f2, n2) = class_metrics([[8, 2, 0], [0, 5, 0], [0, 0, 0]])
    assert (p0, r0, n0) == (1.0, 0.8, 10) and f0 == pytest.approx(2 * 0.8 / 1.8)
    assert (p1, r1, n1) == (5 / 7, 1.0, 5) and f1 == pytest.approx(2 * (5 / 7) / (5 / 7 + 1))
    assert (p2, r2, f2, n2) == (0.0, 0.0, 0.0, 0)
