"""Byte-level text data: a corpus already on every machine, split and batched deterministically.

* Default corpus: the Python standard library's own top-level ``*.py`` sources
  (``sysconfig.get_paths()["stdlib"]``), sorted by name, so every rank of every
  machine with the same Python reads the same bytes; nothing is downloaded.
* ``--data PATH``: a text file, or every non-binary file under a directory
  (sorted by relative path).
* Held-out split: the last ``val_fraction`` of every document (cut at a line
  boundary) is evaluation text; the rest is training text.
* Batches: the training text is cut into consecutive windows of ``block_size + 1``
  bytes (``TokenWindows``), read by a ``torch.utils.data.DataLoader`` whose
  ``DistributedSampler`` shuffles them once per epoch with the seed and gives dp rank
  ``r`` every ``dp``-th window from ``r``. The global batch of step ``s`` is a function
  of ``(seed, s)`` only, so it does not depend on the mesh; a resumed run, even on
  another world size, sees the same data (``batches``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = [
    "Corpus",
    "ResumableDistributedSampler",
    "TokenWindows",
    "batches",
    "decode",
    "eval_batches",
    "load_corpus",
]

_SNIFF = 8192


@dataclasses.dataclass
class Corpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    source: str  # human-readable description
    n_docs: int

    def describe(self) -> str:
        return (
            f"{self.source}: {self.n_docs} documents, {self.train.numel():,} train bytes, "
            f"{self.val.numel():,} held-out bytes"
        )


def _is_text(data: bytes) -> bool:
    return b"\x00" not in data[:_SNIFF]


def _documents(path: str) -> tuple[list[bytes], str]:
    if not path:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.glob("*.py") if p.is_file())
        return [
            p.read_bytes() for p in files
        ], f"Python {sysconfig.get_python_version()} stdlib ({root})"
    p = Path(path).expanduser()
    if p.is_file():
        return [p.read_bytes()], str(p)
    if p.is_dir():
        docs = []
        for f in sorted(q for q in p.rglob("*") if q.is_file()):
            if any(part.startswith(".") for part in f.relative_to(p).parts):
                continue  # .git and friends
            data = f.read_bytes()
            if data and _is_text(data):
                docs.append(data)
        if not docs:
            raise ValueError(f"--data {path}: no text files found under this directory")
        return docs, str(p)
    raise ValueError(f"--data {path}: no such file or directory")


def load_corpus(path: str = "", val_fraction: float = 0.05, max_bytes: int = 0) -> Corpus:
    """Read the corpus and split every document into a training head and held-out tail.

    Args:
        path: File or directory; empty for the Python stdlib sources.
        val_fraction: Fraction of each document held out (cut at a newline).
        max_bytes: Stop reading documents after this many bytes (0: all).
    """
    docs, source = _documents(path)
    train_parts, val_parts, total = [], [], 0
    n_docs = 0
    for doc in docs:
        if max_bytes and total >= max_bytes:
            break
        if max_bytes:
            doc = doc[: max_bytes - total]
        total += len(doc)
        n_docs += 1
        cut = int(len(doc) * (1 - val_fraction))
        nl = doc.rfind(b"\n", 0, cut)
        if nl > 0 and cut - nl < 4096:
            cut = nl + 1
        train_parts.append(doc[:cut])
        val_parts.append(doc[cut:])
    train = b"\n".join(train_parts)
    val = b"\n".join(val_parts)
    return Corpus(
        torch.frombuffer(bytearray(train), dtype=torch.uint8).clone(),
        torch.frombuffer(bytearray(val), dtype=torch.uint8).clone(),
        source,
        n_docs,
    )


class TokenWindows(Dataset):
    """Consecutive windows of ``block_size + 1`` tokens of ``data`` (a map-style dataset).

    Item ``i`` is ``(data[i*b : i*b+b], data[i*b+1 : i*b+b+1])`` with ``b = block_size``:
    inputs and their next-token targets. Only the first ``multiple_of * k`` windows are
    used (the largest such ``k``), so that an epoch splits into whole global batches
    whatever the data-parallel size.

    Raises:
        ValueError: If ``data`` holds fewer than ``multiple_of`` windows.
    """

    def __init__(
        self, data: torch.Tensor, block_size: int, multiple_of: int = 1, what: str = "training"
    ) -> None:
        n = max(data.numel() - 1, 0) // block_size
        n -= n % multiple_of
        if n == 0:
            raise ValueError(
                f"the {what} text has {data.numel():,} bytes: fewer than one batch of "
                f"{multiple_of} windows of --model.block_size {block_size} (+1) bytes; use more "
                "text (--data), a smaller --model.block_size or a smaller --train.batch_size"
            )
        self.data, self.block_size, self.n = data, block_size, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"window {i} out of range [0, {self.n})")
        w = self.data[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return w[:-1], w[1:]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can begin part-way through an epoch.

    ``set_epoch(epoch, start=k)`` makes the next iteration skip this rank's first ``k``
    indices of that epoch's permutation (the permutation itself is unchanged).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


def batches(
    data: torch.Tensor,
    *,
    seed: int,
    batch_size: int,
    grad_accum: int,
    dp_rank: int,
    dp_size: int,
    block_size: int,
    start_step: int = 0,
    pin_memory: bool = False,
    what: str = "training",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's ``(inputs, targets)`` micro-batches from step ``start_step`` on, endlessly.

    A ``DataLoader`` over ``TokenWindows`` with a (resumable) ``DistributedSampler``:
    every epoch is one permutation of the windows seeded by ``(seed, epoch)``, and dp rank
    ``r`` takes every ``dp_size``-th index of it starting at ``r``. Each step consumes
    ``batch_size`` consecutive positions of the permutation in ``grad_accum`` micro-batches,
    so the global batch of step ``s`` (the union over the dp ranks) depends only on
    ``(seed, s)`` and the data, not on the mesh: a resumed run, even on another number of
    ranks, sees the same data. The epoch length is a multiple of ``batch_size`` windows.

    Raises:
        ValueError: If ``data`` holds less than one global batch of windows (at once,
            not at the first ``next``).
    """
    dataset = TokenWindows(data, block_size, multiple_of=batch_size, what=what)
    per_rank = batch_size // (grad_accum * dp_size)
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(
        dataset, batch_size=per_rank, sampler=sampler, drop_last=True, pin_memory=pin_memory
    )
    epoch, step_in_epoch = divmod(start_step, len(dataset) // batch_size)

    def endless(epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            sampler.set_epoch(epoch, start=start)
            yield from loader
            epoch, start = epoch + 1, 0

    return endless(epoch, step_in_epoch * grad_accum * per_rank)


def eval_batches(
    data: torch.Tensor,
    *,
    seed: int,
    n_batches: int,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    block_size: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's share of the first ``n_batches`` held-out batches (same every call)."""
    it = batches(
        data,
        seed=seed,
        batch_size=batch_size,
        grad_accum=1,
        dp_rank=dp_rank,
        dp_size=dp_size,
        block_size=block_size,
        what="held-out",
    )
    return itertools.islice(it, n_batches)


def decode(tokens) -> str:
    """Bytes to text (invalid UTF-8 replaced)."""
    return bytes(int(t) % 256 for t in tokens).decode("utf-8", errors="replace")


if __name__ == "__main__":  # quick look: python examples/gpt/data.py [PATH]
    import sys

    c = load_corpus(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DATA", ""))
    print(c.describe())
    print(decode(c.val[:300].tolist()))
