"""An MLflow SQLite database with its schema already in place, for tests whose subject is not MLflow's first start.

MLflow builds a new database by running its schema migrations: ~6 s in a new process (a ``pyflyte run``), 2-3 s in
one that has built a database before, in every test that points a run at a new ``mlflow.db``. :func:`seed_mlflow_db`
copies a database migrated once per session instead, emptied of experiments as MLflow leaves a new one before its
store starts (the store then creates the ``Default`` experiment, with its artifact location under the run's own
working directory, as on a new database). A run on a new database is still tested: ``default_run`` in
tests/flyte/test_training_pipeline.py (``pyflyte run``) and tests/unit/test_secrets.py (in process) start from none.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from pathlib import Path

_TEMPLATE: list[Path] = []


def _template() -> Path:
    """The session's migrated, experiment-free database (built on first use, under the session's TMPDIR)."""
    if not _TEMPLATE:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        directory = Path(tempfile.mkdtemp(prefix="mlflow-template-"))
        path = directory / "mlflow.db"
        store = SqlAlchemyStore(f"sqlite:///{path}", str(directory / "mlruns"))
        store.engine.dispose()
        with sqlite3.connect(path) as db:
            db.execute("DELETE FROM experiments")  # the Default experiment, whose artifact location names directory
        _TEMPLATE.append(path)
    return _TEMPLATE[0]


def seed_mlflow_db(path: Path) -> str:
    """Put a migrated, empty MLflow database at ``path`` (which must not exist yet); returns its tracking URI."""
    assert not path.exists(), f"{path} exists: seed a database only before its first run"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_template(), path)
    return f"sqlite:///{path}"
