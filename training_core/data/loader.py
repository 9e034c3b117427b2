"""The epoch's sample order, each rank's share of it, and the loader processes that read, decode and augment it.

An epoch's order is a function of (seed, epoch) alone, whatever the number of workers: the training split's shards
in a shuffled order, each shard's samples in a shuffled order, concatenated into one global sequence. A position is
an index into it. The positions not yet trained on are a list of intervals; each rank takes an equal contiguous
chunk of them (``plan_ranks``), so a rank reads a few consecutive shards, one at a time.

A checkpoint records the intervals left (``remaining_after``). A resume on the same number of workers cuts them into
the same chunks, so it continues bit-exactly; on another number of workers it cuts them differently and still
trains every remaining sample of the epoch once, none twice (the order of the rest differs).

Batches come from ``TrainLoader``: with ``data.loader_num_workers`` > 0, torch ``DataLoader`` processes each build
whole batches (batch ``b`` by process ``b mod n``) and the loader yields them in batch order, so what a step sees
does not depend on the number of processes. Each sample's augmentation draws from a generator seeded by (seed,
epoch, sample id), so it does not depend on which process or rank decodes it either.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

log = logging.getLogger(__name__)

Interval = tuple[int, int]
"""``[start, stop)`` positions of an epoch's global order."""


class ShardSamples(Protocol):
    """One shard's samples, read once and indexed by row (a row is a sample's place in the stored shard)."""

    def __len__(self) -> int: ...

    def sample(self, row: int, *, epoch: int, train: bool, seed: int = 0) -> dict[str, Any]:
        """Sample ``row`` as arrays ready to batch (decoded and, for training, augmented with draws seeded by
        ``seed``, ``epoch`` and the sample's id)."""
        ...


ShardReader = Callable[[int], ShardSamples]
"""Reads shard ``index`` of a split (verified against the manifest)."""


class EpochOrder:
    """The global order of one epoch of a split with shards of ``shard_sizes`` samples."""

    def __init__(self, shard_sizes: Sequence[int], *, seed: int, epoch: int) -> None:
        self.seed, self.epoch = seed, epoch
        self.shard_sizes = [int(n) for n in shard_sizes]
        self.shard_order = np.random.default_rng([seed, epoch]).permutation(len(shard_sizes))
        sizes = [self.shard_sizes[i] for i in self.shard_order]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        self.num_samples = self.starts[-1]
        self._rows: dict[int, np.ndarray] = {}

    def locate(self, position: int) -> tuple[int, int]:
        """The shard index and the row in it of ``position``."""
        slot = bisect.bisect_right(self.starts, position) - 1
        shard = int(self.shard_order[slot])
        return shard, int(self.rows(shard)[position - self.starts[slot]])

    def rows(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s rows in this epoch's order."""
        if shard not in self._rows:
            rng = np.random.default_rng([self.seed, self.epoch, shard])
            self._rows[shard] = rng.permutation(self.shard_sizes[shard])
        return self._rows[shard]


def total(intervals: Sequence[Interval]) -> int:
    return sum(stop - start for start, stop in intervals)


def check_intervals(intervals: Sequence[Interval], num_samples: int) -> list[Interval]:
    """``intervals`` when they are ordered, disjoint and within ``[0, num_samples)``; ``ValueError`` otherwise."""
    previous = 0
    for start, stop in intervals:
        if not (isinstance(start, int) and isinstance(stop, int) and previous <= start < stop <= num_samples):
            raise ValueError(
                f"the checkpoint's data position {intervals[:4]!r}... is not a list of ordered, disjoint intervals "
                f"within the epoch's {num_samples} samples; it belongs to other prepared data: resume with the data "
                "the run was trained on"
            )
        previous = stop
    return [(int(a), int(b)) for a, b in intervals]


def _slice(intervals: Sequence[Interval], begin: int, end: int) -> list[Interval]:
    """Positions ``begin..end`` of the concatenation of ``intervals``, as intervals."""
    out, offset = [], 0
    for start, stop in intervals:
        length = stop - start
        lo, hi = max(begin - offset, 0), min(end - offset, length)
        if lo < hi:
            out.append((start + lo, start + hi))
        offset += length
    return out


def plan_ranks(remaining: Sequence[Interval], world_size: int) -> list[list[Interval]]:
    """Each rank's contiguous chunk of ``remaining``: rank ``r`` gets positions ``r*R//W .. (r+1)*R//W`` of their
    concatenation (``R`` positions, ``W`` ranks). Chunks differ by at most one sample; consuming the same number from
    each and planning the rest again for ``W`` ranks gives back each rank's own rest."""
    count = total(remaining)
    return [_slice(remaining, r * count // world_size, (r + 1) * count // world_size) for r in range(world_size)]


def steps_left(remaining: Sequence[Interval], *, world_size: int, samples_per_step: int) -> int:
    """Optimizer steps every rank can take from ``remaining``: the smallest chunk decides."""
    return (total(remaining) // world_size) // samples_per_step


def remaining_after(remaining: Sequence[Interval], *, world_size: int, consumed_per_rank: int) -> list[Interval]:
    """What is left of ``remaining`` once every rank has trained ``consumed_per_rank`` samples of its chunk."""
    left: list[Interval] = []
    for chunk in plan_ranks(remaining, world_size):
        left.extend(_slice(chunk, consumed_per_rank, total(chunk)))
    merged: list[Interval] = []
    for start, stop in left:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """The augmentation seed of one sample in one epoch."""
    return int(np.random.default_rng([seed, epoch, sample_id, 0xA06]).integers(2**62))


def collate(samples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    return {name: np.stack([s[name] for s in samples]) for name in samples[0]}


SHARED_MIN_BYTES = 64 * 1024
"""A batch field at least this large crosses from a loader process through shared memory; a smaller one (labels,
sample ids) is pickled with the batch, which costs less than passing one more file descriptor."""


def shared_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`collate` with each large field stacked straight into shared memory: a tensor sent from a loader
    process crosses through shared memory, and one built in private memory is copied there first (7-10% of a
    loader process's time for 224 px images, ``benchmarks/data_loading.py``). Small fields stay numpy arrays."""
    import torch

    batch = {}
    for name in samples[0]:
        first = np.asarray(samples[0][name])
        shape = (len(samples), *first.shape)
        nbytes = int(np.prod(shape)) * first.dtype.itemsize
        if nbytes < SHARED_MIN_BYTES:
            batch[name] = np.stack([s[name] for s in samples])
            continue
        dtype = torch.from_numpy(np.empty(0, dtype=first.dtype)).dtype
        # What torch's own default_collate does in a loader process: a storage in shared memory, filled in place.
        out = torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes)).view(shape)
        np.stack([s[name] for s in samples], out=out.numpy())
        batch[name] = out
    return batch


@dataclass
class TrainBatches:
    """Batches ``start_batch .. num_batches - 1`` of one rank's chunk; each loader process builds every
    ``num_processes``-th batch. Picklable, so ``DataLoader`` processes may be forked or spawned."""

    read: ShardReader
    order: EpochOrder
    chunk: list[Interval]
    batch_size: int
    num_batches: int
    start_batch: int = 0

    def __post_init__(self) -> None:
        # The loop asks for what the chunk holds (``steps_left``); more would yield empty batches.
        assert self.num_batches * self.batch_size <= total(self.chunk), (self.num_batches, total(self.chunk))

    def batches(self, worker: int = 0, num_processes: int = 1) -> Iterator[list[dict[str, Any]]]:
        """The samples of batches ``worker, worker + num_processes, ...`` (a list per batch, to collate)."""
        current: tuple[int, ShardSamples] | None = None
        for batch in range(self.start_batch + worker, self.num_batches, num_processes):
            samples = []
            for start, stop in _slice(self.chunk, batch * self.batch_size, (batch + 1) * self.batch_size):
                for position in range(start, stop):
                    shard, row = self.order.locate(position)
                    if current is None or current[0] != shard:
                        current = (shard, self.read(shard))  # one shard held at a time
                    samples.append(current[1].sample(row, epoch=self.order.epoch, train=True, seed=self.order.seed))
            yield samples


def loader_iter(
    source: Callable[[int, int], Iterator[Any]], *, num_processes: int, prefetch_batches: int
) -> Iterator[Any]:
    """``source(worker, num_workers)``'s batches (each a list of samples), collated, in ``num_processes`` loader
    processes (0: in this thread), yielded in order: ``DataLoader`` takes one batch from each process in turn, and
    process ``w`` builds batches ``w, w + n, ...``."""
    if num_processes == 0:
        return (collate(samples) for samples in source(0, 1))
    import torch.utils.data

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            return source(info.id, info.num_workers)  # each batch collated in its process (collate_fn)

    loader = torch.utils.data.DataLoader(
        Batches(),
        batch_size=None,
        num_workers=num_processes,
        prefetch_factor=max(1, prefetch_batches // num_processes),
        collate_fn=shared_collate,
        # Forked, whatever the process's default: the batch sources close over the open stream, and a fork
        # starts in milliseconds where a spawned process imports torch again.
        multiprocessing_context="fork",
    )
    # Batches stay numpy for the step: a workload's ``to_device`` takes arrays. ``.numpy()`` shares the memory.
    return (
        {name: value if isinstance(value, np.ndarray) else value.numpy() for name, value in batch.items()}
        for batch in loader
    )
