"""veScale's ``vescale.devicemesh_api``: one global device mesh with strategy accessors.

``VESCALE_DEVICE_MESH.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("DP", "TP"))``
creates the global mesh with ``vescale.dtensor.init_device_mesh``;
``VESCALE_DEVICE_MESH["TP"]`` slices it (torch's sub-mesh) and the accessors name the
strategy dims veScale's way: the last dim is tensor parallelism, the one before it
data parallelism and a third, leading one pipeline parallelism.
"""

from vescale.devicemesh_api._mesh import VESCALE_DEVICE_MESH, VeDeviceMesh

__all__ = ["VESCALE_DEVICE_MESH", "VeDeviceMesh"]
