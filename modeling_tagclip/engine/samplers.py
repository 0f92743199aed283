"""Training samplers whose order is a function of (seed, epoch) or of a JSON-serialisable stream state."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch


class EpochSampler(torch.utils.data.Sampler[tuple[int, int]]):
    """Deterministic shuffle per epoch: permutation from (seed, epoch); the same on every process.

    Items are ``(index, epoch)``, so a dataset seeds its augmentation by epoch even in persistent workers.
    """

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.size).tolist()
        return ((index, self.epoch) for index in order)


class FixedBatchSampler(torch.utils.data.Sampler[list]):
    """Batches drawn up front, ``batches[epoch]`` for each epoch; iterating an epoch twice (``skip_first_batches``
    on resume) gives the same batches."""

    def __init__(self, batches: Sequence[Sequence[Any]], batch_size: int):
        self.batches, self.batch_size, self.epoch = batches, batch_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.batches[0]) if self.batches else 0

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches[self.epoch])


class IdentityBatchSampler(torch.utils.data.Sampler[list[tuple[int, int]]]):
    """fast-reid's ``NaiveIdentitySampler`` as a batch sampler: P identities without replacement, K images each.

    Identities with fewer than K images are sampled with replacement. The reference stream is infinite and runs
    across epochs; an epoch is ``len(ids) // batch_size`` batches. The stream state (generator, identities left
    in the current pass, their remaining images) is plain JSON (``state_dict``), kept at the start of the current
    epoch, so iterating an epoch twice (``skip_first_batches`` on resume) replays the same batches, and a
    checkpoint restores the stream exactly. Items are ``(index, draw)``: ``draw`` numbers every sample of the
    stream, for per-sample augmentation seeds.
    """

    def __init__(self, person_ids: Sequence[int], batch_size: int, num_instances: int, seed: int = 0):
        if num_instances < 1 or batch_size % num_instances or batch_size < num_instances:
            raise ValueError(f"batch_size {batch_size} must be a multiple of num_instances {num_instances}")
        self.batch_size, self.num_instances = batch_size, num_instances
        self.num_pids_per_batch = batch_size // num_instances
        self.index_of: dict[int, list[int]] = {}
        for index, pid in enumerate(np.asarray(person_ids).tolist()):
            self.index_of.setdefault(int(pid), []).append(index)
        if len(self.index_of) < self.num_pids_per_batch:
            raise ValueError(
                f"P x K sampling needs at least P = {self.num_pids_per_batch} identities, got {len(self.index_of)}"
            )
        self.num_samples = len(person_ids)
        rng = np.random.default_rng(seed)
        self.epoch = 0
        self._start = {"rng": rng.bit_generator.state, "available": None, "pools": {}, "drawn": 0}

    def __len__(self) -> int:
        return max(1, self.num_samples // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: the epoch and the stream state at its start."""
        return {"epoch": self.epoch, "stream": self._start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._start = int(state["epoch"]), state["stream"]

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch`` (>= the current one) by drawing the batches in between."""
        if epoch < self.epoch:
            raise ValueError(f"the identity sampler cannot go back from epoch {self.epoch} to {epoch}")
        stream = _Stream(self, self._start)
        for _ in range((epoch - self.epoch) * len(self)):
            stream.next_batch()
        self.epoch, self._start = epoch, stream.state()

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        stream = _Stream(self, self._start)
        for _ in range(len(self)):
            yield stream.next_batch()


class _Stream:
    """The reference's infinite index stream, resumable from ``state()``."""

    def __init__(self, sampler: IdentityBatchSampler, state: dict[str, Any]):
        self.s = sampler
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = state["rng"]
        self.available = None if state["available"] is None else list(state["available"])
        self.pools = {int(pid): list(pool) for pid, pool in state["pools"].items()}
        self.drawn = int(state["drawn"])

    def state(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "available": self.available,
            "pools": {str(pid): pool for pid, pool in self.pools.items()},
            "drawn": self.drawn,
        }

    def next_batch(self) -> list[tuple[int, int]]:
        s = self.s
        if self.available is None or len(self.available) < s.num_pids_per_batch:  # a new pass
            self.available, self.pools = sorted(s.index_of), {}
        batch = []
        for pid in self.rng.choice(self.available, s.num_pids_per_batch, replace=False).tolist():
            if pid not in self.pools:
                pool = list(s.index_of[pid])
                if len(pool) < s.num_instances:
                    pool = self.rng.choice(pool, s.num_instances, replace=True).tolist()
                self.rng.shuffle(pool)
                self.pools[pid] = pool
            batch.extend(self.pools[pid][: s.num_instances])
            del self.pools[pid][: s.num_instances]
            if len(self.pools[pid]) < s.num_instances:
                self.available.remove(pid)
        items = [(index, self.drawn + slot) for slot, index in enumerate(batch)]
        self.drawn += len(batch)
        return items
