"""Write ``breast_cancer.csv``, the table this example trains on when ``data.path`` is empty.

It is scikit-learn's Wisconsin breast cancer table (569 rows, 30 numeric features, shipped with scikit-learn, no
download) with the diagnosis (``malignant``/``benign``) as the last column, the label column. The CSV is committed;
this script is how it was made: ``.venv/bin/python -m examples.tabular_mlp.make_csv``.
"""

from __future__ import annotations

from pathlib import Path

CSV = Path(__file__).with_name("breast_cancer.csv")


def main() -> None:
    from sklearn.datasets import load_breast_cancer

    raw = load_breast_cancer(as_frame=True)
    table = raw.data.copy()
    table["diagnosis"] = [str(raw.target_names[t]) for t in raw.target]
    table.to_csv(CSV, index=False, float_format="%.6g")
    print(f"wrote {CSV}: {len(table)} rows, {table.shape[1] - 1} features")


if __name__ == "__main__":
    main()
