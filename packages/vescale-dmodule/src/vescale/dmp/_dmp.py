"""``auto_parallelize_module``: the automatic plan of vescale-dmodule, by veScale's call."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from vescale.dmodule._api import parallelize_module
from vescale.dmodule._auto_plan import default_sharding_plan

__all__ = ["auto_parallelize_module"]

_POLICIES = ("MEGATRON",)


def auto_parallelize_module(
    model: nn.Module,
    device_mesh: DeviceMesh | None = None,
    policy: str | None = "MEGATRON",
    plan_only: bool = False,
    *,
    sequence_parallel: bool = False,
) -> Any:
    """Parallelize ``model`` over ``device_mesh`` with the automatic Megatron plan.

    Args:
        model: A transformer-style module (not yet parallelized).
        device_mesh: The tensor-parallel mesh (its last dim is tensor parallel unless
            a dim is named ``"tp"``).
        policy: ``"MEGATRON"`` (or ``None``, the same); any other policy is refused.
        plan_only: Return ``(model, device_mesh, plan)`` without parallelizing.
        sequence_parallel: Keep activations sharded on the sequence dim between blocks.

    Returns:
        The parallelized model, or ``(model, device_mesh, plan)`` with ``plan_only``.

    Raises:
        ValueError: No mesh, an unknown policy, or nothing in ``model`` to shard.
    """
    if device_mesh is None:
        raise ValueError("auto_parallelize_module: pass the device mesh")
    if policy is not None and (not isinstance(policy, str) or policy.upper() not in _POLICIES):
        raise ValueError(
            f"auto_parallelize_module: policy {policy!r} is not supported; vescale has "
            f"{list(_POLICIES)} (its automatic Megatron plan)"
        )
    plan = default_sharding_plan(
        model, device_mesh, tp_dim="tp", sequence_parallel=sequence_parallel
    )
    if plan is None:
        raise ValueError(
            f"auto_parallelize_module: found nothing to shard in {type(model).__name__} "
            "(no attention/MLP linears or embeddings by the Megatron rules); write a plan"
        )
    if plan_only:
        return model, device_mesh, plan
    return parallelize_module(model, device_mesh, plan, auto_plan=False)
