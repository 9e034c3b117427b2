"""tasks/flyte_types.py: a config class's Flyte literal type is built once per process, and each caller gets its own
copy of what flytekit itself builds."""

from __future__ import annotations

from dataclasses import dataclass, field

import tasks  # noqa: F401 - installs the remembered literal types, as every Flyte entry point does


@dataclass
class _Inner:
    rate: float = 0.1


@dataclass
class _NeverSeenBefore:
    """A class no other test names, so its first literal type in this process is built here."""

    steps: int = 1
    inner: _Inner = field(default_factory=_Inner)


def test_a_config_classes_literal_type_is_built_once_and_each_caller_gets_its_own_copy_of_flytekits(monkeypatch):
    from flytekit.core.type_engine import DataclassTransformer, TypeEngine

    from training_core.tuning import TuningConfig

    # flytekit's own, which rebuilds it every time (without tasks/flyte_types.py, the method itself)
    build = getattr(DataclassTransformer.get_literal_type, "__wrapped__", DataclassTransformer.get_literal_type)
    built = build(TypeEngine.get_transformer(TuningConfig), TuningConfig)
    first = TypeEngine.to_literal_type(TuningConfig)
    assert first.to_flyte_idl().SerializeToString(deterministic=True) == built.to_flyte_idl().SerializeToString(
        deterministic=True
    )
    first._structure = None  # flytekit changes what it is handed in places (a union variant's tag)
    again = [TypeEngine.to_literal_type(TuningConfig) for _ in range(20)]
    assert all(literal_type == built and literal_type is not first for literal_type in again)

    # Counted, not timed: flytekit's build reads each class it builds through _get_origin_type_in_annotation.
    builds: list[object] = []
    read = DataclassTransformer._get_origin_type_in_annotation

    def counted(self, t):
        builds.append(t)
        return read(self, t)

    monkeypatch.setattr(DataclassTransformer, "_get_origin_type_in_annotation", counted)
    copies = [TypeEngine.to_literal_type(_NeverSeenBefore) for _ in range(21)]
    assert builds.count(_NeverSeenBefore) == 1, "the literal type is built on the first call only"
    assert all(c == copies[0] for c in copies) and len({id(c) for c in copies}) == len(copies)
