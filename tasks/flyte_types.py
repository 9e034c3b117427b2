"""Flyte's literal type of a dataclass, computed once per process (installed by ``tasks/__init__.py``).

Why: flytekit 1.16 rebuilds a dataclass's literal type, its JSON schema included, each time an interface or a node
names the class, and again for every level a dataclass is nested in. Importing ``workflows.launch_plans`` spent 8.9 of
its 10.3 s there (84 calls for the same few config classes); a ``pyflyte run`` of the tuning pipeline, 73 calls. The
literal type depends on the class alone, so the first answer is kept and each caller gets its own copy: flytekit
changes the object it is handed in places (a union variant's tag). What Flyte serializes is unchanged.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from flytekit.core.type_engine import DataclassTransformer
from flytekit.models.types import LiteralType


def install() -> None:
    """Make ``DataclassTransformer.get_literal_type`` remember its answer per class (once per process)."""
    compute = DataclassTransformer.get_literal_type
    if getattr(compute, "remembers", False):
        return
    known: dict[Any, LiteralType] = {}

    @functools.wraps(compute)
    def get_literal_type(self: DataclassTransformer, t: Any) -> LiteralType:
        try:
            literal_type = known.get(t)
        except TypeError:  # an unhashable annotation: nothing to key on
            return compute(self, t)
        if literal_type is None:
            literal_type = known[t] = compute(self, t)
        return copy.deepcopy(literal_type)

    get_literal_type.remembers = True
    DataclassTransformer.get_literal_type = get_literal_type
