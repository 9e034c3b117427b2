"""Work spread over the connected Ray cluster as plain Ray tasks of one CPU, a bounded number at a time: image prep's
shard tasks and text prep's tokenising (``data.prep_num_workers`` at a time).

Plain tasks rather than Ray Data: on the prep's own cluster, Ray Data's executor ran ``map(concurrency=2)`` over 48
rows of 0.1 s of work in 5.7 s on 2 CPUs (1 at a time: 6.9 s), where plain tasks took 2.5 s (5.0 s), so 2 prep
workers were barely faster than 1. Tasks keep what Ray Data gave prep: CPU scheduling across the cluster's nodes and
retries of a task lost with its worker or node.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator


def map_tasks(
    function: Callable[..., Any], arguments: Iterable[tuple], *, num_workers: int, ordered: bool
) -> Iterator[Any]:
    """``function(*args)`` for each ``args`` of ``arguments``, each a Ray task of one CPU, ``num_workers`` running at
    once; ``arguments`` is drawn lazily, as tasks finish.

    ``ordered``: results come in the order of ``arguments``, and at most ``num_workers`` finished results wait behind
    a slower task, so the caller holds a bounded number of results however many tasks there are. Otherwise they come
    as tasks finish. A task lost with its worker or node is retried by Ray (3 times by default); an exception raised
    by ``function`` is raised here. Tasks still running when the caller stops reading are cancelled (Ray interrupts
    Python code; a task blocked in native code runs to its end, its result dropped)."""
    assert num_workers >= 1, num_workers  # the configs check prep_num_workers
    import ray

    remote = ray.remote(num_cpus=1)(function)
    running: dict[Any, int] = {}  # task -> the number of its arguments
    finished: dict[int, Any] = {}  # ordered: results waiting for an earlier one
    pending, next_index = enumerate(arguments), 0
    try:
        while True:
            # Ordered, a task starts only while fewer than ``num_workers`` results wait: they and the running tasks'
            # results are all the caller's results in memory at once.
            room = num_workers - len(running) if len(finished) < num_workers else 0
            # Each task is in ``running`` once started; no name here keeps its (large) arguments past their upload.
            running.update((remote.remote(*args), index) for index, args in itertools.islice(pending, room))
            if next_index in finished:
                yield finished.pop(next_index)
                next_index += 1
            elif running:
                (done,), _ = ray.wait(list(running), num_returns=1)
                index = running.pop(done)
                if ordered:
                    finished[index] = ray.get(done)
                else:
                    yield ray.get(done)
            else:
                return
    finally:
        for task in running:
            ray.cancel(task)
