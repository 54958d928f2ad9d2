"""``VeDeviceMesh``: a holder of the global mesh; every accessor reads torch's mesh."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vescale.dtensor._collectives_impl import resolve_mesh_dim
from vescale.dtensor.device_mesh import init_device_mesh

__all__ = ["VeDeviceMesh", "VESCALE_DEVICE_MESH"]

_DEFAULT_NAMES = ("PP", "DP", "TP")


class VeDeviceMesh:
    """veScale's global device mesh API over one ``vescale.dtensor.DeviceMesh``.

    Strategy dims are counted from the last mesh dim: ``0`` is tensor parallelism (the
    last dim), ``1`` data parallelism, ``2`` pipeline parallelism (a 3-D mesh is
    ``(PP, DP, TP)``). A 1-D mesh is both the data- and the tensor-parallel mesh.
    """

    def __init__(self) -> None:
        self._mesh: DeviceMesh | None = None
        self._names: tuple[str, ...] = ()

    # ------------------------------------------------------------------ creation
    def init_device_mesh(
        self,
        device_type: str,
        mesh_shape: Sequence[int],
        *,
        mesh_dim_names: Sequence[str] | None = None,
        check_uniqueness: bool = False,
    ) -> DeviceMesh:
        """Create (or re-create) the global mesh over the whole world.

        Args:
            device_type: ``"cpu"`` or ``"cuda"``; an index (``"cuda:0"``) is dropped with
                a warning, as veScale does.
            mesh_shape: 1 to 3 positive sizes whose product is the world size.
            mesh_dim_names: One name per dim; default ``("PP", "DP", "TP")``'s last
                ``len(mesh_shape)`` names.
            check_uniqueness: Raise if a global mesh already exists.

        Returns:
            The new global mesh.

        Raises:
            ValueError: A global mesh exists and ``check_uniqueness``; a shape of more
                than 3 dims; anything ``vescale.dtensor.init_device_mesh`` rejects.
        """
        if check_uniqueness and self._mesh is not None:
            raise ValueError(
                "VESCALE_DEVICE_MESH is already initialized; pass check_uniqueness=False to "
                "re-create it"
            )
        if isinstance(device_type, str) and ":" in device_type:
            warnings.warn(
                f"VESCALE_DEVICE_MESH: device type {device_type!r} has an index; using "
                f"{device_type.split(':')[0]!r}",
                stacklevel=2,
            )
            device_type = device_type.split(":")[0]
        shape = tuple(mesh_shape)
        if not 1 <= len(shape) <= 3:
            raise ValueError(
                f"VESCALE_DEVICE_MESH supports 1 to 3 mesh dims ((PP,) DP, TP), got shape {shape}"
            )
        names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        if names is None:
            names = _DEFAULT_NAMES[-len(shape) :]
        self._mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        self._names = tuple(names)
        return self._mesh

    def get(self, **kwargs) -> DeviceMesh | None:
        """The global mesh; with keyword arguments, creates it first if there is none."""
        if self._mesh is None and kwargs:
            self.init_device_mesh(**kwargs)
        return self._mesh

    # ------------------------------------------------------------------ helpers
    def _require(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError(
                "VESCALE_DEVICE_MESH is not initialized; call "
                "VESCALE_DEVICE_MESH.init_device_mesh(device_type, mesh_shape, ...) first"
            )
        return self._mesh

    def _strategy_name(self, strategy: int) -> str:
        """Name of strategy dim ``strategy`` (0: TP, 1: DP, 2: PP), counted from the end."""
        self._require()
        if strategy >= len(self._names):
            strategy = len(self._names) - 1  # a 1-D mesh is both DP and TP
        return self._names[len(self._names) - 1 - strategy]

    def _index(self, dim: int | str) -> int:
        return resolve_mesh_dim(self._require(), dim, "mesh dim")

    # ------------------------------------------------------------------ views
    def __getitem__(self, mesh_dim_name: str) -> DeviceMesh:
        """The sub-mesh of one named dim (torch's slicing)."""
        return self._require()[mesh_dim_name]

    def get_tensor_parallel_mesh(self) -> DeviceMesh:
        """The tensor-parallel (last) dim's sub-mesh."""
        return self._require()[self._strategy_name(0)]

    def get_data_parallel_mesh(self) -> DeviceMesh:
        """The data-parallel dim's sub-mesh (the only dim of a 1-D mesh)."""
        return self._require()[self._strategy_name(1)]

    def get_pipeline_parallel_mesh(self) -> DeviceMesh:
        """The pipeline-parallel (first of three) dim's sub-mesh."""
        if self.ndim != 3:
            raise ValueError(f"no pipeline-parallel dim on a {self.ndim}-dim mesh (needs 3)")
        return self._require()[self._strategy_name(2)]

    def get_data_parallel_dim_groups(self) -> dist.ProcessGroup:
        """The process group of the data-parallel dim."""
        return self._require().get_group(self._strategy_name(1))

    def get_tensor_parallel_dim_groups(self) -> dist.ProcessGroup:
        """The process group of the tensor-parallel dim."""
        return self._require().get_group(self._strategy_name(0))

    # ------------------------------------------------------------------ ranks
    def get_strategy_coordinate(self, local_rank: int | None = None) -> list[int]:
        """The mesh coordinate of global rank ``local_rank`` (default: this rank)."""
        mesh = self._require()
        if local_rank is None:
            coord = mesh.get_coordinate()
            if coord is None:
                raise ValueError("this rank is not part of the global mesh")
            return list(coord)
        hits = (mesh.mesh == int(local_rank)).nonzero()
        if hits.numel() == 0:
            raise ValueError(f"rank {local_rank} is not part of the global mesh")
        return [int(x) for x in hits[0]]

    def lookup_rank(self, dim: int | str) -> int:
        """This rank's coordinate on mesh dim ``dim`` (index or name)."""
        return self.get_strategy_coordinate()[self._index(dim)]

    def get_strategy_size(self, dim: int | str) -> int:
        """Size of mesh dim ``dim`` (index or name)."""
        return self.size(self._index(dim))

    def get_local_rank(self) -> int:
        """This process's rank on its machine (``LOCAL_RANK``, else the global rank)."""
        self._require()
        return int(os.environ.get("LOCAL_RANK", dist.get_rank()))

    def get_tensor_parallel_rank(self) -> int:
        """This rank's coordinate on the tensor-parallel dim."""
        return self.lookup_rank(self._strategy_name(0))

    def get_data_parallel_rank(self) -> int:
        """This rank's coordinate on the data-parallel dim."""
        return self.lookup_rank(self._strategy_name(1))

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's pipeline stage (0 without a pipeline dim)."""
        return self.lookup_rank(self._strategy_name(2)) if self.ndim == 3 else 0

    def is_first_stage(self) -> bool:
        """True on the first pipeline stage (always, without a pipeline dim)."""
        return self.get_pipeline_parallel_rank() == 0

    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (always, without a pipeline dim)."""
        if self.ndim != 3:
            return True
        return self.get_pipeline_parallel_rank() == self.size(0) - 1

    def get_coordinate(self) -> list[int] | None:
        """This rank's mesh coordinate (``None`` outside the mesh)."""
        return self._require().get_coordinate()

    def size(self, dim: int | None = None) -> int:
        """Ranks in the mesh, or the size of mesh dim ``dim``."""
        mesh = self._require()
        return mesh.mesh.numel() if dim is None else int(mesh.mesh.size(dim))

    @property
    def ndim(self) -> int:
        """Number of mesh dims."""
        return self._require().ndim

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape."""
        return tuple(self._require().mesh.shape)

    def get_global_tensor_parallel_meshes(self) -> list[DeviceMesh]:
        """Refused: meshes of other ranks' groups need process groups this rank is not in."""
        raise NotImplementedError(
            "VESCALE_DEVICE_MESH.get_global_tensor_parallel_meshes is not provided by vescale: "
            "it builds meshes without process groups for ranks outside this rank's groups; "
            "use VESCALE_DEVICE_MESH.get().mesh (the rank grid) instead"
        )

    def get_global_pipeline_parallel_meshes(self, device_type: str = "cuda") -> list[DeviceMesh]:
        """Refused, like ``get_global_tensor_parallel_meshes``."""
        raise NotImplementedError(
            "VESCALE_DEVICE_MESH.get_global_pipeline_parallel_meshes is not provided by "
            "vescale (pipeline parallelism is not part of vescale); use "
            "VESCALE_DEVICE_MESH.get().mesh (the rank grid) instead"
        )

    def __repr__(self) -> str:
        if self._mesh is None:
            return "VeDeviceMesh(uninitialized)"
        return f"VeDeviceMesh({self._mesh})"


#: The global device mesh of a veScale program.
VESCALE_DEVICE_MESH = VeDeviceMesh()
