"""Secrets stay secret: the userinfo of a URL never reaches a log line, MLflow or a checkpoint.

The first tests pin :func:`training_core.redact.redact` on the forms a URL with credentials takes. The others
run the real thing with marker credentials in every field that may hold a URL, and grep everything the run
left for the markers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.helpers.runtime import InProcessRuntime
from training_core.config import TrainingConfig
from training_core.data import prepare
from training_core.records import WorkerArgs
from training_core.redact import REDACTED_LOGGERS, RedactingFilter, install_log_redaction, redact
from training_core.train.loop import run_worker


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://user:password@host", "http://***@host"),
        ("s3://KEY:SECRET@bucket/checkpoints", "s3://***@bucket/checkpoints"),
        ("http://user:pw@pushgateway:9091/metrics", "http://***@pushgateway:9091/metrics"),
        ("http://user:pw@[::1]:9091/metrics", "http://***@[::1]:9091/metrics"),
        ("http://user:pw@[fe80::1%25eth0]/x", "http://***@[fe80::1%25eth0]/x"),
        ("https://user:p@ss@w@rd@host/path", "https://***@host/path"),
        ("postgresql+psycopg2://app:pw@db:5432/mlflow", "postgresql+psycopg2://***@db:5432/mlflow"),
        ("HTTPS://USER:PW@HOST", "HTTPS://***@HOST"),
        ("ssh://git@example.com/repo", "ssh://***@example.com/repo"),
        ("http://:token@host", "http://***@host"),
        # Pasted unencoded: an S3 secret holds "/" (and "+"), a password may hold "?" or "#".
        ("s3://AKIAEXAMPLE:wJalr/K7MDENG+bPxRfiCY@bucket/key", "s3://***@bucket/key"),
        ("http://user:pa?ss#w/rd@host/", "http://***@host/"),
        ("storage_uri=s3://k:s@b", "storage_uri=s3://***@b"),
        ("prefix_http://u:p@h", "prefix_http://***@h"),
        (
            "pushing to http://u1:p1@a:1/x failed; s3://k2:s2@b2/y, then http://u3:p3@c",
            "pushing to http://***@a:1/x failed; s3://***@b2/y, then http://***@c",
        ),
        ("http://u1:p1@h1,http://u2:p2@h2", "http://***@h1,http://***@h2"),
        ("http://h1,http://u2:p2@h2", "http://h1,http://***@h2"),
        ("<a href='http://u:p@h/'>http://u:p@h/</a>", "<a href='http://***@h/'>http://***@h/</a>"),
    ],
)
def test_redact_strips_the_userinfo_of_every_url_in_a_text(text, expected):
    assert redact(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "alice@example.com wrote to bob@example.org",
        "mailto:alice@example.com",
        "/data/runs/a@b/step-00000010",
        "relative/dir@2/file.json",
        "http://host:8080/users/@alice",
        "https://registry:5000/v2/image@sha256:0123abcd",
        "https://medium.com/@author/post",
        "http://[::1]:9091/metrics@x",
        "sqlite:////tmp/mlflow.db",
        "git@github.com:org/repo.git",
        "http://host:8080 and bob@example.com",
        "no url here: user:password@host",
    ],
)
def test_redact_leaves_emails_paths_and_urls_without_userinfo_alone(text, monkeypatch):
    from training_core import redact as redaction

    monkeypatch.setattr(redaction, "_SEEN_USERINFO", {})  # the pattern alone: no credential seen in this process
    assert redact(text) == text


def test_a_user_and_password_seen_in_a_url_are_redacted_wherever_they_appear_again(monkeypatch):
    from training_core import redact as redaction

    monkeypatch.setattr(redaction, "_SEEN_USERINFO", {})
    quoted = 'Invalid bucket name "AKIAEXAMPLE:wJalr/K7MDENG@bucket"'  # botocore, after fsspec stripped s3://
    assert redact(quoted) == quoted  # never seen in a URL: text
    assert redact("s3://AKIAEXAMPLE:wJalr/K7MDENG@bucket/data") == "s3://***@bucket/data"
    assert redact(quoted) == 'Invalid bucket name "***@bucket"'
    assert redact("s3://alice@bucket/x") == "s3://***@bucket/x" and redact("alice wrote") == "alice wrote"
    for i in range(70):  # the newest 64 are kept
        redact(f"https://user{i}:pw{i}secret@host/")
    assert len(redaction._SEEN_USERINFO) == 64 and redact("user69:pw69secret") == "***"


def test_redact_rewrites_json_text_and_copies_mappings_and_lists_without_changing_them():
    config = {
        "observability": {"pushgateway_url": "http://u:p@gw:9091"},
        "checkpoint": {"storage_path": "s3://K:S@bucket"},
        "paths": ["s3://K:S@a", ("http://u:p@b", 3)],
        "http://u:p@key": 1.5,
    }
    original = json.loads(json.dumps(config, default=list))
    redacted = redact(config)
    assert redacted == {
        "observability": {"pushgateway_url": "http://***@gw:9091"},
        "checkpoint": {"storage_path": "s3://***@bucket"},
        "paths": ["s3://***@a", ("http://***@b", 3)],
        "http://***@key": 1.5,
    }
    assert json.loads(json.dumps(config, default=list)) == original  # the input is untouched
    text = json.dumps(config, default=list)
    assert json.loads(redact(text)) == json.loads(json.dumps(redacted, default=list))
    assert redact(7) == 7 and redact(None) is None


# A port the credentials "belong to" (the ambiguity the URL standard resolves the same way): not redacted.
def test_redact_reads_digits_after_the_colon_as_a_port_as_the_url_standard_does():
    assert redact("http://user:8080/rest@host") == "http://user:8080/rest@host"


@pytest.fixture
def log_redaction():
    """:func:`install_log_redaction` for one test; the filters are removed afterwards, so the run tests below
    prove that the call sites redact by themselves."""
    child = logging.getLogger("training_core.test_secrets_child")
    install_log_redaction()
    yield child
    for name in list(logging.root.manager.loggerDict):
        if any(name == root or name.startswith(f"{root}.") for root in REDACTED_LOGGERS):
            logger = logging.getLogger(name)
            for f in [f for f in logger.filters if isinstance(f, RedactingFilter)]:
                logger.removeFilter(f)


def test_the_log_filter_redacts_messages_arguments_and_tracebacks_of_the_project_loggers(log_redaction, caplog, capfd):
    install_log_redaction()  # a second call adds no second filter
    assert sum(isinstance(f, RedactingFilter) for f in logging.getLogger("training_core").filters) == 1
    handler = logging.StreamHandler()  # stderr, as a worker's basicConfig sets it up
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("training_core").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO):
            logging.getLogger("training_core").warning("pushing to %s failed", "http://LOGUSER1:LOGPASS1@gw:9091")
            logging.getLogger("tasks").info("storage s3://LOGUSER2:LOGPASS2@bucket/x")
            log_redaction.error("child %(url)s", {"url": "http://LOGUSER3:LOGPASS3@h"})
            try:
                raise OSError("cannot reach s3://LOGUSER4:LOGPASS4@bucket/ckpt")
            except OSError:
                logging.getLogger("training_core").exception("save failed")
    finally:
        logging.getLogger("training_core").removeHandler(handler)
    stderr = capfd.readouterr().err
    assert "pushing to http://***@gw:9091 failed" in caplog.text and "s3://***@bucket/x" in caplog.text
    assert "child http://***@h" in caplog.text and "OSError: cannot reach s3://***@bucket/ckpt" in caplog.text
    assert "pushing to http://***@gw:9091 failed" in stderr and "s3://***@bucket/ckpt" in stderr
    for marker in ("LOGUSER", "LOGPASS"):
        assert marker not in caplog.text and marker not in stderr
        assert not any(marker in r.getMessage() or marker in (r.exc_text or "") for r in caplog.records)


def test_the_log_filter_passes_a_malformed_record_through_unchanged_for_its_handler_to_report():
    record = logging.LogRecord("training_core", logging.WARNING, __file__, 1, "bad %d", ("http://u:p@h",), None)
    assert RedactingFilter().filter(record) is True
    assert record.msg == "bad %d" and record.args == ("http://u:p@h",)


def test_report_pages_and_decks_carry_no_url_credentials():
    from tasks import reports

    sections = [
        reports.section("Run", reports.table([("checkpoints", "s3://RPTKEY:RPTSECRET@bucket/ckpt")]), section_id="run")
    ]
    page = reports.page("Training report", sections)
    deck = reports.deck(sections, marker="s3://RPTKEY:RPTSECRET@bucket/raw/report.html")
    for text in (page, deck):
        assert "RPTKEY" not in text and "RPTSECRET" not in text
    assert "s3://***@bucket/ckpt" in page and "data-report='s3://***@bucket/raw/report.html'" in deck


# One user and password per field, each unique, so a leak names the field it came from.
MARKERS = {
    "observability.pushgateway_url": ("MKPGUSER7q", "MKPGPASS9z"),
    "TRAINING_PUSHGATEWAY_URL": ("MKENVUSER4k", "MKENVPASS2w"),
    "checkpoint.storage_path": ("MKCKUSER6t", "MKCKPASS1x"),
    "tracking.tracking_uri": ("MKTRUSER3v", "MKTRPASS8n"),
    "data.path": ("MKDATAUSER5m", "MKDATAPASS0p"),
}


def _leaks(text: str | bytes, where: str) -> list[str]:
    """``field: where`` for each marker found in ``text`` (case-insensitive, in case a store folds case)."""
    haystack = (text.decode("utf-8", "replace") if isinstance(text, bytes) else text).lower()
    return [f"{field}: {where}" for field, pair in MARKERS.items() for m in pair if m.lower() in haystack]


def _url(field: str, host: str) -> str:
    user, password = MARKERS[field]
    return f"{host.split('://')[0]}://{user}:{password}@{host.split('://')[1]}"


@pytest.fixture
def memory_storage():
    """fsspec's in-memory filesystem, where a URL's userinfo survives as part of the path: the checkpoints are
    written to and read from a real ``memory://user:password@bucket/...`` location. Emptied afterwards."""
    import fsspec

    fs = fsspec.filesystem("memory")
    yield fs
    for path in list(fs.store):
        if MARKERS["checkpoint.storage_path"][0] in path:
            fs.store.pop(path, None)
    for path in list(fs.pseudo_dirs):
        if MARKERS["checkpoint.storage_path"][0] in path:
            fs.pseudo_dirs.remove(path)


def test_marker_credentials_in_every_url_field_reach_no_log_mlflow_record_or_checkpoint(
    tmp_path, monkeypatch, caplog, capfd, memory_storage
):
    """Two runs of the real loop (in this process, one rank): the first gets the Pushgateway from
    ``TRAINING_PUSHGATEWAY_URL``, the second (a fine-tune of the first's checkpoint) from the config. Every URL
    field carries marker credentials; the pushes fail (a closed port) and are logged, the checkpoints are
    written to and read back from the credentialed location. Then logs, the MLflow store (params, tags, every
    artifact, the database file) and every file of every checkpoint are searched for the markers."""
    from mlflow.tracking import MlflowClient

    from training_core import tracking
    from training_core.config import DataConfig, TrackingConfig
    from training_core.records import MlflowRun
    from training_core.runners.launch import free_port
    from training_core.runners.ray_train import checkpoint_root, collect_final

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root (./mlruns) lands here
    closed = f"127.0.0.1:{free_port()}"
    storage_path = _url("checkpoint.storage_path", "memory://bucket/runs")
    monkeypatch.setenv("TRAINING_PUSHGATEWAY_URL", _url("TRAINING_PUSHGATEWAY_URL", f"http://{closed}"))
    data_dir = str(tmp_path / "digits")
    prepare(TrainingConfig().data, data_dir)

    def config(*, stop_at_epoch: int, pushgateway_url: str) -> TrainingConfig:
        return TrainingConfig.from_dict(
            {
                "data": {"path": _url("data.path", "s3://bucket/raw/digits")},  # digits ignores it: only recorded
                "model": {"name": "small_cnn"},
                "loop": {"epochs": 2, "stop_at_epoch": stop_at_epoch, "batch_size": 128, "log_interval_steps": 4},
                "checkpoint": {"storage_path": storage_path, "interval_steps": 5, "keep_last": 2, "async_save": False},
                "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
                # The loop connects to the MLflow run it is given (sqlite below); the config's URI is only recorded.
                "tracking": {"tracking_uri": _url("tracking.tracking_uri", f"http://{closed}/mlflow")},
                "observability": {
                    "pushgateway_url": pushgateway_url,
                    "push_timeout_s": 1.0,
                    "nvml": False,
                    "host": False,
                    "mlflow_system_metrics": False,
                },
            }
        )

    store = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment_name="secrets")
    run_ids, finals = [], []
    caplog.set_level(logging.INFO)
    for name, cfg, resume_from in (
        ("from-env", config(stop_at_epoch=1, pushgateway_url=""), ""),
        (
            "fine-tune",
            config(stop_at_epoch=0, pushgateway_url=_url("observability.pushgateway_url", f"http://{closed}")),
            None,
        ),
    ):
        tracking_uri, run_id = tracking.create_run(store, run_name=name, tags={"storage": storage_path})
        root = checkpoint_root(storage_path, name)
        args = WorkerArgs.build(
            cfg,
            data_dir=data_dir,
            checkpoint_root=root,
            run_name=name,
            mlflow=MlflowRun(tracking_uri=tracking_uri, run_id=run_id),
            resume_from=finals[-1].checkpoint_uri if resume_from is None else "",
            log_params=True,
        )
        run_worker(args, InProcessRuntime())
        tracking.finish_run(tracking_uri, run_id)
        run_ids.append(run_id)
        finals.append(collect_final(cfg, root, str(tmp_path / name), what=name))

    # A data.path whose credentials reach an error message: a dataset that reads it, at a missing location.
    with pytest.raises(ValueError) as missing:
        prepare(DataConfig(dataset="cifar10", path=_url("data.path", "memory://bucket/missing.tar.gz")), data_dir)
    logging.getLogger("training_core").error("prepare failed: %s", missing.value)

    client = MlflowClient(tracking_uri=store.tracking_uri)
    params = [client.get_run(run_id).data.params for run_id in run_ids]
    leaks: list[str] = []
    captured = capfd.readouterr()
    leaks += _leaks(captured.out + captured.err, "stdout/stderr")
    leaks += _leaks(caplog.text, "log records")
    leaks += _leaks(str(missing.value), "the missing data.path error")
    for run_id, run_params in zip(run_ids, params):
        run = client.get_run(run_id)
        leaks += _leaks(json.dumps(run_params), f"params of {run_id}")
        leaks += _leaks(json.dumps(run.data.tags), f"tags of {run_id}")
        assert "config.json" in {a.path for a in client.list_artifacts(run_id)}
    artifact_files = [p for p in (tmp_path / "mlruns").rglob("*") if p.is_file()]
    assert any(p.name == "config.json" for p in artifact_files)
    for path in [*artifact_files, tmp_path / "mlflow.db"]:
        leaks += _leaks(path.read_bytes(), str(path.relative_to(tmp_path)))
    # Every file of every checkpoint: where training wrote them (their paths hold the real URL, their contents
    # must not), and the local copies collect_final made.
    written = [p for p in memory_storage.find(storage_path.split("://", 1)[1]) if "/step-" in p]
    assert len(written) > 6
    for path in written:
        leaks += _leaks(memory_storage.cat_file(path), path.rsplit("/runs/", 1)[1])
    for final in finals:
        for path in Path(final.checkpoint_dir).rglob("*"):
            if path.is_file():
                leaks += _leaks(path.read_bytes(), str(path.relative_to(tmp_path)))
    assert not leaks, "\n".join(leaks)

    # The runs used the real values: they pushed (and failed) to both URLs, resumed from the credentialed
    # location and recorded every field, redacted.
    assert finals[1].meta.resumed_from_steps == [finals[0].meta.global_step]
    assert finals[0].checkpoint_uri.startswith(storage_path)
    pushes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pushing metrics to")]
    assert len(pushes) == 2 and all(f"http://***@{closed}" in p for p in pushes), pushes
    assert any(r.getMessage().startswith("resumed from memory://***@bucket/runs/") for r in caplog.records)
    for run_params in params:
        assert run_params["checkpoint.storage_path"] == "memory://***@bucket/runs"
        assert run_params["tracking.tracking_uri"] == f"http://***@{closed}/mlflow"
        assert run_params["data.path"] == "s3://***@bucket/raw/digits"
        assert run_params["observability.pushgateway_url"] == f"http://***@{closed}"
    assert finals[1].meta.config["observability"]["pushgateway_url"] == f"http://***@{closed}"
