"""veScale's optimizer wrappers, as thin layers over vescale's optimizers.

- ``DistributedOptimizer`` (``vescale.optim.distributed_optimizer``): veScale's
  arguments (an optimizer class or instance, ``models=[ddp]``, ``clip_grad``,
  ``grad_to_fp32``, ``optimizer_kwargs``) mapped onto
  ``vescale.optim.DistributedOptimizer``, which it subclasses.
- ``BasicOptimizer`` (``vescale.optim.base_optimizer``): a torch optimizer for
  models whose gradients are already synchronized (vescale's DDP leaves them in
  ``.grad``), finishing ``parallelize_module``'s ``Partial`` gradient reduction first.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from vescale.optim._zero import DistributedOptimizer as _DistributedOptimizer

__all__ = [
    "DistributedOptimizer",
    "OptimizerBase",
    "BasicOptimizer",
    "GradOptimizerHookBase",
    "BasicOptimizerHook",
]

logger = logging.getLogger(__name__)


def _is_ddp(m: Any) -> bool:
    """veScale's DDP wrapper (``vescale.ddp``), recognised without importing vescale-dmodule."""
    return (
        isinstance(m, nn.Module)
        and hasattr(m, "use_distributed_optimizer")
        and hasattr(m, "zero_grad_buffer")
    )


class DistributedOptimizer(_DistributedOptimizer):
    """veScale's ZeRO-2 optimizer: ``vescale.optim.DistributedOptimizer`` by veScale's arguments.

    Args:
        optimizer: An element-wise ``torch.optim.Optimizer`` class (built with
            ``optimizer_kwargs``) or a fresh instance over the models' parameters (its
            param groups and hyper-parameters are used; it is not stepped itself).
        models: The ``vescale.ddp.DistributedDataParallel`` models, built with
            ``use_distributed_optimizer=True``, all over the same data-parallel mesh.
        clip_grad: Clip gradients to this global L2 norm; ``0.0`` disables clipping.
        overlap_param_gather: Overlap the parameter all-gathers with the next forward.
        grad_to_fp32: Reduce gradients in fp32, and keep fp32 master weights and states
            for non-fp32 parameters.
        optimizer_kwargs: Keyword arguments of the optimizer class.
        **kwargs: Refused (named in the error).

    Raises:
        ValueError: No models, a model without ``use_distributed_optimizer`` (as in
            veScale), models over different data-parallel meshes, an optimizer instance
            that has state already.
        TypeError: Unknown keyword arguments, a model that is not veScale's DDP, or
            what ``vescale.optim.DistributedOptimizer`` rejects.
    """

    def __init__(
        self,
        optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer,
        models: Sequence[nn.Module],
        clip_grad: float = 0.0,
        overlap_param_gather: bool = False,
        grad_to_fp32: bool = True,
        optimizer_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(f"DistributedOptimizer got unknown keyword arguments {sorted(kwargs)}")
        if isinstance(models, nn.Module):
            models = [models]
        models = list(models)
        if not models:
            raise ValueError(
                "DistributedOptimizer: at least one model must be given (models=[ddp])"
            )
        for m in models:
            if not _is_ddp(m):
                raise TypeError(
                    "DistributedOptimizer: every model must be wrapped by "
                    f"vescale.ddp.DistributedDataParallel, got {type(m).__name__}"
                )
            if not m.use_distributed_optimizer:
                raise ValueError(
                    "DistributedOptimizer: build the DDP models with "
                    "use_distributed_optimizer=True (their gradients are reduce-scattered by "
                    "this optimizer)"
                )
        mesh, dp_dim = models[0].mesh, models[0].dp_dim
        for m in models[1:]:
            if m.mesh != mesh or m.dp_dim != dp_dim:
                raise ValueError(
                    "DistributedOptimizer: the models are data parallel over different meshes "
                    f"({mesh} dim {dp_dim} and {m.mesh} dim {m.dp_dim})"
                )
        module = models[0].module if len(models) == 1 else nn.ModuleList(m.module for m in models)
        if isinstance(optimizer, torch.optim.Optimizer):
            if optimizer.state:
                raise ValueError(
                    "DistributedOptimizer: the optimizer instance has state already; pass a "
                    "fresh one (or the class and optimizer_kwargs)"
                )
            cls = type(optimizer)
            params: Any = [dict(g) for g in optimizer.param_groups]
            for g in params:
                g["params"] = list(g["params"])
            inner_kwargs: dict[str, Any] = {}
        elif isinstance(optimizer, type):
            cls = optimizer
            params = module
            inner_kwargs = dict(optimizer_kwargs or {})
        else:
            raise TypeError(
                "DistributedOptimizer: optimizer must be a torch.optim.Optimizer class or "
                f"instance, got {optimizer!r}"
            )
        low = any(p.dtype != torch.float32 for p in module.parameters())
        reduce_fp32 = grad_to_fp32 or any(
            getattr(m, "accumulate_allreduce_grads_in_fp32", False) for m in models
        )
        super().__init__(
            params,
            cls,
            mesh=mesh,
            dp_dim=dp_dim,
            master_dtype=torch.float32 if grad_to_fp32 and low else None,
            grad_reduce_dtype=torch.float32 if reduce_fp32 else None,
            clip_grad_norm=float(clip_grad) if clip_grad else None,
            model=module,
            overlap_param_gather=overlap_param_gather,
            **inner_kwargs,
        )
        self.models = models
        for m in models:
            attach = getattr(m, "_attach_optimizer", None)
            if callable(attach):
                attach(self)  # ddp.zero_grad_buffer() resets this optimizer's gradients

    def clip_grad_norm(self, clip_grad: float) -> torch.Tensor:
        """veScale's name for ``clip_grad_norm_`` (after the reduce-scatter)."""
        return self.clip_grad_norm_(clip_grad)

    def get_loss_scale(self) -> float:
        """Always ``1.0`` (no loss scaling)."""
        return 1.0


class GradOptimizerHookBase(ABC):
    """veScale's optimizer-step hooks: ``step_pre_hook`` / ``step_post_hook`` (static)."""

    @staticmethod
    @abstractmethod
    def step_pre_hook(optim: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Runs before ``optim.step()``."""

    @staticmethod
    @abstractmethod
    def step_post_hook(optim: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Runs after ``optim.step()``."""


class BasicOptimizerHook(GradOptimizerHookBase):
    """veScale's default hook. A no-op: vescale keeps gradients in ``.grad`` (no ``main_grad``)."""

    @staticmethod
    def step_pre_hook(optim: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def step_post_hook(optim: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        return None


class OptimizerBase(ABC):
    """veScale's optimizer wrapper base: holds ``optimizer`` and forwards ``param_groups``.

    Args:
        optimizer: The wrapped optimizer.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the optimizer's state."""

    @abstractmethod
    def step(self) -> Any:
        """One optimizer step."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (set ``lr`` here)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    def get_loss_scale(self) -> float:
        """Always ``1.0`` (no loss scaling)."""
        return 1.0


class BasicOptimizer(OptimizerBase):
    """veScale's ``BasicOptimizer``: a torch optimizer for tensor/data-parallel models.

    ``step()`` first finishes the ``Partial`` gradient reduction of models parallelized
    by ``parallelize_module`` (a no-op when it already ran at the end of backward) and
    then steps the optimizer; models wrapped by veScale's DDP have synchronized
    gradients already.

    Args:
        optimizer: A torch optimizer over the models' parameters.
        models: The model(s).
        grad_hook: A ``GradOptimizerHookBase`` subclass whose hooks are registered
            on ``optimizer`` (default: the no-op ``BasicOptimizerHook``).

    Raises:
        ValueError: A DDP model built with ``use_distributed_optimizer=True`` (as in
            veScale: use ``DistributedOptimizer``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        models: nn.Module | Sequence[nn.Module],
        grad_hook: type[GradOptimizerHookBase] | None = BasicOptimizerHook,
    ) -> None:
        super().__init__(optimizer)
        self.models = [models] if isinstance(models, nn.Module) else list(models)
        if any(getattr(m, "use_distributed_optimizer", False) for m in self.models):
            raise ValueError(
                "BasicOptimizer: a DDP model uses use_distributed_optimizer=True; use "
                "vescale.optim.distributed_optimizer.DistributedOptimizer"
            )
        if grad_hook is not None:
            self.register_optimizer_hook(grad_hook)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Finish ``Partial`` gradient reductions, then step the optimizer."""
        for m in self.models:
            target = m.module if _is_ddp(m) else m
            sync = getattr(target, "finish_grad_sync", None)
            if callable(sync):
                sync()
            elif not _is_ddp(m):
                logger.warning("%s has no finish_grad_sync(); stepping as is", type(m).__name__)
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients (and the DDP models' gradient buffers)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for m in self.models:
            if _is_ddp(m):
                m.zero_grad_buffer(zero_buffer=True)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def register_optimizer_hook(self, grad_hook: type[GradOptimizerHookBase]) -> None:
        """Register ``grad_hook``'s step pre/post hooks on the wrapped optimizer."""
        self.optimizer.register_step_pre_hook(grad_hook.step_pre_hook)
        self.optimizer.register_step_post_hook(grad_hook.step_post_hook)
