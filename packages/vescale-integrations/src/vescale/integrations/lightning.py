"""A PyTorch Lightning strategy that parallelizes the model with vescale.

```python
import lightning.pytorch as pl
from vescale.integrations.lightning import VescaleStrategy

trainer = pl.Trainer(
    strategy=VescaleStrategy(mesh_shape=(2, 2), data_parallel={"dp": "fsdp"}),
    accelerator="cpu",
    devices=4,
)
```

Needs the ``lightning`` package (``pip install vescale-integrations[lightning]``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,  # Lightning's own torchrun-like launcher (no public name)
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "vescale.integrations.lightning needs PyTorch Lightning: "
        "pip install 'vescale-integrations[lightning]'"
    ) from exc

import vescale.checkpoint as vckpt
from vescale.dmodule import parallelize_module
from vescale.dtensor import init_device_mesh

__all__ = ["VescaleStrategy"]

_META = "lightning.pt"  # Lightning's own checkpoint entries (loops, callbacks, hparams, ...)
_STATE = "vescale"  # the vescale checkpoint of the module and optimizers


def _plain(out: Any) -> Any:
    """DTensors in a model's output -> whole plain tensors (differentiable)."""
    if isinstance(out, DTensor):
        return out.full_tensor()
    if isinstance(out, Mapping) and hasattr(out, "__setitem__"):  # dict, HF ModelOutput
        for k in list(out.keys()):
            out[k] = _plain(out[k])
        return out
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # namedtuple
        return type(out)(*(_plain(v) for v in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_plain(v) for v in out)
    return out


class VescaleStrategy(ParallelStrategy):
    """Train a `LightningModule` with vescale's tensor and data parallelism.

    The model inside the `LightningModule` stays unmodified: in ``setup`` the strategy
    builds the device mesh and calls `vescale.dmodule.parallelize_module` on it, before
    Lightning calls ``configure_optimizers`` (so the optimizer sees the sharded
    parameters). Processes are started by Lightning's subprocess launcher (the script
    runs again once per rank, as under ``torchrun``); a script already launched by
    ``torchrun`` or a cluster is used as it is.

    Its outputs are made plain: every DTensor in the parallelized model's output (the
    loss, the logits, ...) is returned as the whole tensor, differentiably, so
    ``training_step`` and ``self.log`` see what a single device sees.

    Checkpoints: ``trainer.save_checkpoint(path)`` and ``ModelCheckpoint`` write a
    directory: ``path/vescale`` is a `vescale.checkpoint` checkpoint of the
    `LightningModule` and its optimizers (every rank writes its own shards), and
    ``path/lightning.pt`` holds Lightning's other entries (loops, callbacks,
    schedulers, hyperparameters), written by rank 0. ``fit(ckpt_path=path)`` loads them
    after the model is parallelized and the optimizers are built, so a checkpoint saved
    under one layout (say FSDP x TP) resumes under another (TP alone, another mesh):
    `vescale.checkpoint.load` reshards.

    The distributed sampler gets the data-parallel size and rank: the product of the
    ``data_parallel`` dims. Ranks that differ only in tensor-parallel dims see the same
    batches.

    Args:
        mesh_shape: The device mesh, e.g. ``(2, 2)``; its product must be the number of
            processes (``devices * num_nodes``). ``None``: one dim over every process.
        mesh_dim_names: Names of the mesh dims. Default: ``("dp", "tp")`` for two dims;
            for one dim ``("dp",)`` when ``data_parallel`` is given, else ``("tp",)``.
        data_parallel: Mesh dim name -> ``"ddp"`` | ``"fsdp"`` (or an options dict), as
            `parallelize_module`'s ``data_parallel``; a string applies to ``"dp"``.
            ``None``: no data parallelism.
        sharding_plan: The plan for `parallelize_module`. ``None``: the automatic plan
            over the ``"tp"`` dim when the mesh has one, no tensor parallelism otherwise.
        checkpoint: Options for `vescale.checkpoint.save` (``async_op``,
            ``keep_last``, ...).
        module: Attribute of the `LightningModule` to parallelize (``"model"``).
            ``None``: its only child module that holds parameters, or the
            `LightningModule` itself when there are several.
        parallelize_options: More keyword arguments for `parallelize_module`
            (``sequence_parallel``, ``param_init_fn``, ...).
        process_group_backend: ``"gloo"`` on CPU, ``"nccl"`` on CUDA by default.
    """

    strategy_name = "vescale"

    def __init__(
        self,
        mesh_shape: tuple[int, ...] | None = None,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
        data_parallel: str | dict[str, Any] | None = None,
        sharding_plan: dict[str, Any] | None = None,
        checkpoint: dict[str, Any] | None = None,
        module: str | None = None,
        parallelize_options: dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(data_parallel, str):
            data_parallel = {"dp": data_parallel}
        self._mesh_shape = tuple(mesh_shape) if mesh_shape is not None else None
        self._mesh_dim_names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        self._data_parallel = dict(data_parallel or {})
        self._sharding_plan = sharding_plan
        self._checkpoint = dict(checkpoint or {})
        self._module_name = module
        self._options = dict(parallelize_options or {})
        self._backend = process_group_backend
        self._mesh = None
        self.num_nodes = 1
        if self._mesh_shape is not None and self._mesh_dim_names is not None:
            if len(self._mesh_shape) != len(self._mesh_dim_names):
                raise ValueError(
                    f"VescaleStrategy: mesh_shape {self._mesh_shape} and mesh_dim_names "
                    f"{self._mesh_dim_names} differ in length"
                )

    # ------------------------------------------------------------------ processes

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning's hint for custom strategies: add a distributed sampler."""
        return True

    @property
    def device_mesh(self):
        """The vescale `DeviceMesh` (after ``setup_environment``)."""
        if self._mesh is None:
            raise RuntimeError("VescaleStrategy.device_mesh: the processes are not set up yet")
        return self._mesh

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        super().setup_environment()
        env = self.cluster_environment
        assert env is not None
        env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        env.set_world_size(self.num_nodes * self.num_processes)
        pl.utilities.rank_zero_only.rank = self.global_rank
        shape = self._mesh_shape or (self.world_size,)
        if int(torch.tensor(shape).prod()) != self.world_size:
            raise ValueError(
                f"VescaleStrategy: mesh_shape {shape} holds {int(torch.tensor(shape).prod())} "
                f"ranks, but the trainer runs {self.world_size} processes"
            )
        names = self._mesh_dim_names
        if names is None:
            names = ("dp", "tp") if len(shape) == 2 else None
            if names is None and len(shape) == 1:
                names = ("dp",) if self._data_parallel else ("tp",)
            if names is None:
                raise ValueError("VescaleStrategy: give mesh_dim_names for a mesh of 3+ dims")
        for dim in self._data_parallel:
            if dim not in names:
                raise ValueError(
                    f"VescaleStrategy: data_parallel names mesh dim {dim!r}, not in {names}"
                )
        if not dist.is_initialized():
            os.environ["MASTER_ADDR"] = env.main_address
            os.environ["MASTER_PORT"] = str(env.main_port)
            backend = self._backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
            dist.init_process_group(backend, rank=self.global_rank, world_size=self.world_size)
        self._mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self.device_mesh
        replicas, rank = 1, 0
        for dim in mesh.mesh_dim_names:
            if dim in self._data_parallel:
                size = mesh[dim].size()
                replicas, rank = replicas * size, rank * size + mesh.get_local_rank(dim)
        return {"num_replicas": replicas, "rank": rank}

    # ------------------------------------------------------------------ the model

    def _target(self) -> nn.Module:
        lm = self.lightning_module
        assert lm is not None
        if self._module_name is not None:
            target = getattr(lm, self._module_name, None)
            if not isinstance(target, nn.Module):
                raise AttributeError(
                    f"VescaleStrategy(module={self._module_name!r}): the LightningModule has "
                    "no such submodule"
                )
            return target
        holders = [m for m in lm.children() if any(True for _ in m.parameters())]
        return holders[0] if len(holders) == 1 else lm

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        target = self._target()
        mesh = self.device_mesh
        plan = self._sharding_plan
        if plan is None and "tp" not in mesh.mesh_dim_names:
            plan = {}  # no tensor-parallel dim: data parallelism only
        opts = dict(self._options)
        if self._data_parallel:
            opts["data_parallel"] = self._data_parallel
        parallelize_module(target, mesh, plan, **opts)
        target.register_forward_hook(lambda _m, _a, out: _plain(out))
        self.barrier()
        if trainer.state.fn == pl.trainer.states.TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ collectives

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        out = tensor.detach().clone()
        op = str(reduce_op).lower() if reduce_op is not None else "mean"
        if op in ("max", "reduceop.max"):
            dist.all_reduce(out, dist.ReduceOp.MAX, group=group)
            return out
        if op in ("min", "reduceop.min"):
            dist.all_reduce(out, dist.ReduceOp.MIN, group=group)
            return out
        if not out.is_floating_point():
            out = out.float()
        dist.all_reduce(out, dist.ReduceOp.SUM, group=group)
        if op in ("mean", "avg", "reduceop.avg"):
            out /= dist.get_world_size(group)
        return out

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False):
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the parallelized model and the built optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores them

    def _state(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        state: dict[str, Any] = {"model": self.lightning_module}
        for i, opt in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = getattr(opt, "_optimizer", opt)
        return state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # saved from the live module by save_checkpoint

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # saved from the live optimizer by save_checkpoint

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("VescaleStrategy.save_checkpoint: storage_options is not supported")
        path = Path(self.broadcast(os.fspath(filepath)))
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if self.is_global_zero:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
            torch.save(meta, path / _META)
        self.barrier()
        vckpt.save(path / _STATE, self._state(), **self._checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        path = Path(self.broadcast(os.fspath(checkpoint_path)))
        if not (path / _META).is_file():
            raise FileNotFoundError(
                f"{path}: not a VescaleStrategy checkpoint (no {_META}; expected a directory "
                "written by trainer.save_checkpoint under VescaleStrategy)"
            )
        strict = getattr(self.lightning_module, "strict_loading", True)
        vckpt.load(path / _STATE, self._state(), strict=strict)
        return torch.load(path / _META, weights_only=False)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint has loaded the module

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint has loaded the optimizers

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
