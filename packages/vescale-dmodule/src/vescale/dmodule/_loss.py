"""Cross-entropy over vocabulary-sharded logits, without gathering them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, ignore_index, reduction):
        x = logits.float()
        vocab_local = x.shape[-1]
        # Global max (for stability; no gradient flows through it).
        m = x.amax(dim=-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = x - m.unsqueeze(-1)
        e = x.exp()
        local_t = target - vocab_start
        outside = (local_t < 0) | (local_t >= vocab_local)
        local_t = local_t.masked_fill(outside, 0)
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        # One collective for the softmax denominator and the target logit.
        both = torch.stack([e.sum(-1), picked])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        sum_e, picked = both[0], both[1]
        valid = target != ignore_index
        loss = (sum_e.log() - picked).masked_fill(~valid, 0.0)
        count = valid.sum()
        e.div_(sum_e.unsqueeze(-1))  # local slice of the softmax
        ctx.save_for_backward(e, local_t, outside, valid, count)
        ctx.reduction = reduction
        ctx.in_dtype = logits.dtype
        if reduction == "mean":
            out = loss.sum() / count
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, outside, valid, count = ctx.saved_tensors
        g = softmax
        hit = (~outside).to(g.dtype)
        g.scatter_add_(-1, local_t.unsqueeze(-1), -hit.unsqueeze(-1))
        g.mul_(valid.unsqueeze(-1).to(g.dtype))
        if ctx.reduction == "mean":
            g.mul_(grad / count)
        elif ctx.reduction == "sum":
            g.mul_(grad)
        else:
            g.mul_(grad.unsqueeze(-1))
        return g.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: DTensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of logits sharded on the vocabulary dim, without gathering them.

    Equivalent to ``F.cross_entropy(logits.full_tensor().flatten(0, -2),
    target.flatten(), ignore_index=ignore_index, reduction=reduction)`` in value and
    gradient, but each rank only ever holds its vocabulary slice: the forward issues
    two ``all_reduce`` calls of ``target.numel()`` elements (the max, then the
    softmax denominator stacked with the target logit), the backward none.

    Args:
        logits: A DTensor ``[..., V]`` that is ``Shard(-1)`` (the last dim) on
            exactly one mesh dim and ``Replicate()`` on all others, e.g. the output
            of a column-parallel ``lm_head`` whose output plan keeps ``Shard(-1)``.
        target: Class indices ``[...]`` (plain tensor, or a replicated DTensor), the
            same on every rank; ``ignore_index`` entries do not count.
        ignore_index: Target value to ignore.
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"``.

    Returns:
        A plain tensor (the same on every rank): a scalar, or ``target``'s shape for
        ``reduction="none"``. Calling ``backward()`` on it reaches ``logits``.

    Raises:
        ValueError: ``logits`` is not sharded on its last dim as described, or the
            shapes do not match.
    """
    if not isinstance(logits, DTensor):
        raise ValueError("vocab_parallel_cross_entropy expects a DTensor sharded on the vocab dim")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    ndim = logits.ndim
    mesh = logits.device_mesh
    shard_dims = []
    for i, p in enumerate(logits.placements):
        if isinstance(p, Shard) and p.dim % ndim == ndim - 1:
            shard_dims.append(i)
        elif not p.is_replicate():
            raise ValueError(
                f"logits placements {[str(p) for p in logits.placements]}: every mesh dim must "
                "be Shard on the last (vocab) dim or Replicate"
            )
    if len(shard_dims) != 1:
        raise ValueError(
            f"logits must be Shard(-1) on exactly one mesh dim, got "
            f"{[str(p) for p in logits.placements]}"
        )
    dim = shard_dims[0]
    if isinstance(target, DTensor):
        target = target.full_tensor()
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match logits shape "
            f"{tuple(logits.shape)} without its last dim"
        )
    vocab = logits.shape[-1]
    n = mesh.size(dim)
    if vocab % n:
        raise ValueError(f"vocab size {vocab} is not divisible by the mesh dim size {n}")
    start = mesh.get_local_rank(dim) * (vocab // n)
    local = logits.to_local()
    return _VocabParallelCE.apply(
        local, target.to(local.device), start, mesh.get_group(dim), ignore_index, reduction
    )
