"""Byte-level text data: a corpus already on every machine, split and batched deterministically.

* Default corpus: the Python standard library's own top-level ``*.py`` sources
  (``sysconfig.get_paths()["stdlib"]``), sorted by name, so every rank of every
  machine with the same Python reads the same bytes; nothing is downloaded.
* ``--data PATH``: a text file, or every non-binary file under a directory
  (sorted by relative path).
* Held-out split: the last ``val_fraction`` of every document (cut at a line
  boundary) is evaluation text; the rest is training text.
* Batches: the global batch of step ``s`` is a function of ``(seed, s)`` only, so it
  does not depend on the mesh; dp rank ``r`` takes its contiguous share of each
  micro-batch. A resumed run, even on another world size, sees the same data.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus", "batch_for_step", "eval_batches"]

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


def _windows(data: torch.Tensor, starts: torch.Tensor, block_size: int) -> torch.Tensor:
    idx = starts.unsqueeze(1) + torch.arange(block_size + 1).unsqueeze(0)
    return data[idx].long()


def _check_len(data: torch.Tensor, block_size: int, what: str) -> None:
    if data.numel() < block_size + 2:
        raise ValueError(
            f"the {what} text has {data.numel()} bytes, fewer than block_size + 2 = "
            f"{block_size + 2}; use more text or a smaller --model.block_size"
        )


def batch_for_step(
    data: torch.Tensor,
    *,
    step: int,
    micro: int,
    seed: int,
    batch_size: int,
    grad_accum: int,
    dp_rank: int,
    dp_size: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's ``(inputs, targets)`` for micro-batch ``micro`` of step ``step``.

    The step's ``batch_size`` random windows are drawn from a generator seeded by
    ``(seed, step)``; micro-batch ``m`` is the ``m``-th of ``grad_accum`` equal
    slices and dp rank ``r`` takes the ``r``-th of ``dp_size`` slices of that.
    """
    _check_len(data, block_size, "training")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - block_size - 1, (batch_size,), generator=g)
    per_micro = batch_size // grad_accum
    per_rank = per_micro // dp_size
    lo = micro * per_micro + dp_rank * per_rank
    xy = _windows(data, starts[lo : lo + per_rank], block_size)
    return xy[:, :-1], xy[:, 1:]


def eval_batches(
    data: torch.Tensor,
    *,
    seed: int,
    n_batches: int,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    block_size: int,
):
    """Yield this dp rank's share of ``n_batches`` fixed held-out batches (same every call)."""
    _check_len(data, block_size, "held-out")
    g = torch.Generator().manual_seed(seed * 7_919 + 17)
    per_rank = batch_size // dp_size
    for _ in range(n_batches):
        starts = torch.randint(0, data.numel() - block_size - 1, (batch_size,), generator=g)
        xy = _windows(data, starts[dp_rank * per_rank : (dp_rank + 1) * per_rank], block_size)
        yield xy[:, :-1], xy[:, 1:]


def decode(tokens) -> str:
    """Bytes to text (invalid UTF-8 replaced)."""
    return bytes(int(t) % 256 for t in tokens).decode("utf-8", errors="replace")


if __name__ == "__main__":  # quick look: python examples/gpt/data.py [PATH]
    import sys

    c = load_corpus(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DATA", ""))
    print(c.describe())
    print(decode(c.val[:300].tolist()))
