"""Secrets stay secret: the userinfo of a URL never reaches a log line, MLflow or a checkpoint.

The first tests pin :func:`training_core.redact.redact` on the forms a URL with credentials takes. The others
run the real thing with marker credentials in every field that may hold a URL, and grep everything the run
left for the markers.
"""

from __future__ import annotations

import json
import logging

import pytest

from training_core.redact import REDACTED_LOGGERS, RedactingFilter, install_log_redaction, redact


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
def test_redact_leaves_emails_paths_and_urls_without_userinfo_alone(text):
    assert redact(text) == text


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
