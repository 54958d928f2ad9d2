"""``Muon`` over sharded parameters: each matrix is orthogonalized whole, on one rank."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vescale.dtensor import from_local, redistribute
from vescale.optim._utils import local_of, normalize_param_groups, ragged_shard

__all__ = ["Muon", "newton_schulz", "adjust_lr"]

_DEFAULT_NS = (3.4445, -4.7750, 2.0315)
_DEFAULT_ADAMW_NAMES = (
    r"(^|\.)(embed|embedding|embeddings|wte|wpe|tok_embeddings)(\.|$)",
    r"(^|\.)(lm_head|output)(\.|$)",
)


def newton_schulz(
    g: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float
) -> torch.Tensor:
    """Approximately orthogonalize a matrix with a quintic Newton–Schulz iteration (bf16).

    The same computation as ``torch.optim.Muon``: the matrix is cast to bf16,
    transposed to be wide, scaled to unit Frobenius norm (clamped at ``eps``), then
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, ``steps`` times.

    Args:
        g: A 2-D matrix.
        coefficients: ``(a, b, c)``.
        steps: Number of iterations (< 100).
        eps: Lower clamp of the norm.

    Returns:
        The bf16 result, same shape as ``g``.
    """
    if g.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.bfloat16()
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Muon's shape-dependent learning-rate scale (as ``torch.optim.Muon``)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    """Zeros with ``t``'s layout (a DTensor keeps its placements, plugin ones included)."""
    if isinstance(t, DTensor):
        return from_local(
            torch.zeros_like(local_of(t)),
            t.device_mesh,
            t.placements,
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
        )
    return torch.zeros_like(t, memory_format=torch.preserve_format)


def _ns_cost(shape: Sequence[int]) -> int:
    m, n = int(shape[0]), int(shape[1])
    return m * n * min(m, n)


class Muon(torch.optim.Optimizer):
    """Muon for sharded (DTensor) parameters, with AdamW for the non-matrix ones.

    Matrix parameters (2-D, not matched by ``adamw_names``) get the update of
    `torch.optim.Muon`: momentum ``B <- mu B + (1 - mu) g`` (as ``lerp``),
    nesterov ``u = lerp(g, B, mu)``, Newton–Schulz orthogonalization of ``u`` in bf16,
    decoupled weight decay, and the ``adjust_lr_fn`` scale. Newton–Schulz needs the
    whole matrix, so for a DTensor parameter each matrix is given one *root* rank
    (greedy load balance by ``rows * cols * min(rows, cols)`` over all ranks of the
    mesh). The momentum-smoothed update is gathered to the root with
    ``redistribute(u, mesh, [RaggedShard((), one_hot(root))] * ...)`` (the whole
    matrix on one rank, no copy on the others), orthogonalized there and scattered
    back to the parameter's placements with ``redistribute``; all gathers are issued
    before the roots compute, so each rank computes only its own share. Momentum
    and the parameter update stay on the local shards (element-wise).

    Any placement works (``Shard``, ``RaggedShard``, ``Replicate`` ...; a ``Partial``
    gradient is reduced to the parameter's placements first). Plain tensors are
    updated locally on every rank.

    Everything else (biases, norms, embeddings, ``lm_head``, 0/1/3+-D tensors) uses
    AdamW (decoupled weight decay), element-wise on the local shards.

    Args:
        params: An ``nn.Module`` (names are matched against ``adamw_names``), an
            iterable of parameters or of param-group dicts; a group may set
            ``use_muon`` to force either path.
        lr: Muon learning rate.
        weight_decay: Muon decoupled weight decay.
        momentum: Muon momentum.
        nesterov: Nesterov momentum.
        ns_coefficients: Newton–Schulz ``(a, b, c)``.
        eps: Newton–Schulz norm clamp.
        ns_steps: Newton–Schulz iterations.
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"``.
        adamw_lr: AdamW learning rate (default: ``lr``).
        adamw_betas: AdamW betas.
        adamw_eps: AdamW epsilon.
        adamw_weight_decay: AdamW decoupled weight decay (default: ``weight_decay``).
        adamw_names: Regexes (``re.search`` on parameter names, modules only) of
            2-D parameters that still use AdamW (embeddings and ``lm_head`` by default).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = _DEFAULT_NS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        adamw_names: Sequence[str] = _DEFAULT_ADAMW_NAMES,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}"
            )
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if ns_steps >= 100:
            raise ValueError("ns_steps must be less than 100")
        groups, names = normalize_param_groups(params)
        patterns = [re.compile(p) for p in adamw_names]
        adamw_defaults = {
            "lr": lr if adamw_lr is None else adamw_lr,
            "betas": tuple(adamw_betas),
            "eps": adamw_eps,
            "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        }
        split: list[dict[str, Any]] = []
        for g in groups:
            forced = g.get("use_muon")
            muon_ps, adam_ps = [], []
            for p in g["params"]:
                name = names[id(p)]
                if forced is None:
                    use = p.ndim == 2 and not any(r.search(name) for r in patterns)
                else:
                    use = bool(forced)
                if use and p.ndim != 2:
                    raise ValueError(
                        f"Muon only supports 2-D parameters; {name!r} has shape {tuple(p.shape)} "
                        "(set use_muon=False on its group to use AdamW)"
                    )
                (muon_ps if use else adam_ps).append(p)
            extra = {k: v for k, v in g.items() if k not in ("params", "use_muon")}
            if muon_ps:
                split.append({**extra, "params": muon_ps, "use_muon": True})
            if adam_ps:
                ag = {
                    **adamw_defaults,
                    **{k: v for k, v in extra.items() if k.startswith("adamw_")},
                }
                ag = {k.removeprefix("adamw_"): v for k, v in ag.items()}
                split.append({**ag, "params": adam_ps, "use_muon": False})
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "betas": tuple(adamw_betas),
            "use_muon": True,
        }
        super().__init__(split, defaults)
        #: Number of matrices orthogonalized by this rank in the last step.
        self.last_local_ns = 0
        #: NS cost units (``rows * cols * min``) computed by this rank in the last step.
        self.last_local_cost = 0

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _grad_like_param(p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if isinstance(p, DTensor):
            if not isinstance(g, DTensor):
                raise TypeError("a DTensor parameter needs a DTensor gradient")
            if tuple(g.placements) != tuple(p.placements) or g.device_mesh is not p.device_mesh:
                g = redistribute(g, p.device_mesh, p.placements)
        return g

    def _adamw(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = local_of(self._grad_like_param(p))
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = _zeros_like(p)
                state["exp_avg_sq"] = _zeros_like(p)
            state["step"] += 1
            step = float(state["step"])
            x, m, v = local_of(p), local_of(state["exp_avg"]), local_of(state["exp_avg_sq"])
            if wd:
                x.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
            x.addcdiv_(m, denom, value=-lr / (1 - beta1**step))

    def _assign_roots(self, items: list[tuple[torch.Tensor, Any]]) -> list[int | None]:
        """Greedy load balance: biggest matrices first, each to the least-loaded rank."""
        roots: list[int | None] = [None] * len(items)
        loads: dict[Any, list[int]] = {}
        order = sorted(range(len(items)), key=lambda i: -_ns_cost(items[i][0].shape))
        for i in order:
            p, _ = items[i]
            if not isinstance(p, DTensor):
                continue
            mesh = p.device_mesh
            load = loads.setdefault(mesh, [0] * mesh.size())
            r = min(range(len(load)), key=lambda k: (load[k], k))
            load[r] += _ns_cost(p.shape)
            roots[i] = r
        return roots

    def _muon(self, groups: list[dict[str, Any]]) -> None:
        items: list[tuple[torch.Tensor, dict[str, Any]]] = []
        updates: list[torch.Tensor] = []
        for group in groups:
            mu, nesterov = group["momentum"], group["nesterov"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = self._grad_like_param(p)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = _zeros_like(g)
                buf = state["momentum_buffer"]
                gl, bl = local_of(g), local_of(buf)
                bl.lerp_(gl, 1 - mu)
                ul = gl.lerp(bl, mu) if nesterov else bl
                if isinstance(p, DTensor):
                    u = from_local(
                        ul,
                        p.device_mesh,
                        p.placements,
                        shape=tuple(p.shape),
                        stride=tuple(p.stride()),
                    )
                else:
                    u = ul
                items.append((p, group))
                updates.append(u)
        roots = self._assign_roots(items)

        # 1) gather every matrix to its root (collectives in the same order on all ranks)
        gathered: list[Any] = []
        for (p, _), u, root in zip(items, updates, roots):
            if root is None:
                gathered.append(u)
                continue
            mesh = p.device_mesh
            coord = [int(c) for c in torch.unravel_index(torch.tensor(root), tuple(mesh.shape))]
            target = [
                ragged_shard((), tuple(int(k == coord[d]) for k in range(mesh.size(d))))
                for d in range(mesh.ndim)
            ]
            gathered.append((redistribute(u, mesh, target), target))
        # 2) orthogonalize this rank's share
        self.last_local_ns = 0
        self.last_local_cost = 0
        results: list[Any] = []
        for (p, group), got, root in zip(items, gathered, roots):
            coefs, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
            if root is None:
                results.append(newton_schulz(got, coefs, steps, eps))
                continue
            dt, target = got
            local = local_of(dt)
            if local.numel():
                out = newton_schulz(local.reshape(p.shape), coefs, steps, eps)
                self.last_local_ns += 1
                self.last_local_cost += _ns_cost(p.shape)
                results.append((out.reshape(local.shape), target))
            else:
                results.append((local.new_empty(local.shape, dtype=torch.bfloat16), target))
        # 3) scatter back and apply
        for (p, group), res, root in zip(items, results, roots):
            if root is None:
                upd = res
            else:
                local, target = res
                mesh = p.device_mesh
                o = from_local(local, mesh, target, shape=tuple(p.shape), stride=tuple(p.stride()))
                upd = local_of(redistribute(o, mesh, p.placements))
            lr = group["lr"]
            x = local_of(p)
            x.mul_(1 - lr * group["weight_decay"])
            x.add_(upd, alpha=-adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon step (AdamW for the non-matrix parameters).

        Every rank must call it with the same parameters (it issues collectives).

        Args:
            closure: Optional closure re-evaluating the loss.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon([g for g in self.param_groups if g["use_muon"]])
        for g in self.param_groups:
            if not g["use_muon"]:
                self._adamw(g)
        return loss
