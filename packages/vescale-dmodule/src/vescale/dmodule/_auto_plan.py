"""Megatron-style tensor(+sequence)-parallel plans derived from a model's structure.

This is vescale-dmodule's own answer to the ``vescale_sharding_plan`` hook
(registered ``trylast``, so any plugin answering first overrides it).

Rules (applied to leaf modules by the last component of their name):

* Token embeddings (``nn.Embedding`` whose name does not mention positions):
  vocabulary-parallel, weight ``Shard(0)``; output ``Replicate()`` (all-reduce), or
  ``Shard(seq_dim)`` with sequence parallelism (reduce-scatter).
* Column-parallel linears (``q_proj k_proj v_proj query key value wq wk wv
  fc1 c_fc fc_in up_proj gate_proj w1 w3 dense_h_to_4h lm_head``): weight and bias
  sharded on the output features.
* Row-parallel linears (``o_proj out_proj wo c_proj fc2 fc_out down_proj w2
  dense_4h_to_h``, and ``dense`` inside an attention module): weight sharded on the
  input features, bias replicated; output ``Replicate()`` (all-reduce) or
  ``Shard(seq_dim)`` with sequence parallelism (reduce-scatter).
* ``lm_head``: column-parallel; output gathered to ``Replicate()`` so any loss works
  (override ``"lm_head.output": [[Shard(-1)]]`` and use
  `vescale.dmodule.vocab_parallel_cross_entropy` to never gather logits).
* Norms (class name containing ``Norm``): replicated; with sequence parallelism
  their output is gathered to ``Replicate()`` (the all-gather before attention, MLP
  and ``lm_head`` in pre-norm transformers).
* GPT-2's fused QKV projection ``c_attn`` (``[q; k; v]`` blocks, split into three
  equal parts by the model): column-parallel as ``_StridedShard(out, split_factor=3)``
  on weight and bias, so each rank holds the same heads of q, k and v and the split
  yields ``Shard`` q/k/v without communication (vescale-dtensor adds the split and
  cat rules). Other fused names (``qkv Wqkv query_key_value qkv_proj``) stay
  replicated: their layouts differ by model (per-head interleaving, GQA's unequal
  parts); plan them by hand.
* HF ``Conv1D`` (GPT-2; weight stored ``[in, out]``) is handled with transposed dims.

A layer whose sharded dim does not divide by the tensor-parallel size is left
replicated, and so is a q/k/v (or fused) projection whose head count does not divide
(GQA's key/value heads on a larger tp; the head size is read from the attention
module's ``head_dim`` or ``head_size``). Names with layer indices are generalised to ``\\d+`` regexes.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from vescale.dmodule._compat import StridedShard as _StridedShard

__all__ = ["default_sharding_plan", "resolve_tp_dim"]

COLWISE = {
    "q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
    "fc1", "c_fc", "fc_in", "up_proj", "gate_proj", "w1", "w3", "dense_h_to_4h",
    "lm_head",
}  # fmt: skip
ROWWISE = {
    "o_proj", "out_proj", "wo", "c_proj", "fc2", "fc_out", "down_proj", "w2",
    "dense_4h_to_h",
}  # fmt: skip
FUSED_QKV = {"qkv", "c_attn", "wqkv", "query_key_value", "qkv_proj"}
_POSITION = re.compile(r"(^|_)(wpe|pos|position|positions|position_embeddings)($|_)")


def resolve_tp_dim(mesh: DeviceMesh, tp_dim: int | str | None) -> int:
    """Index of the tensor-parallel mesh dim.

    ``None`` or ``"tp"`` on a mesh without that name: the last mesh dim.
    """
    names = mesh.mesh_dim_names or ()
    if isinstance(tp_dim, int) and not isinstance(tp_dim, bool):
        if not -mesh.ndim <= tp_dim < mesh.ndim:
            raise ValueError(f"tp_dim {tp_dim} is out of range for a {mesh.ndim}-dim mesh")
        return tp_dim % mesh.ndim
    if tp_dim is None or (tp_dim == "tp" and "tp" not in names):
        return mesh.ndim - 1
    if tp_dim not in names:
        raise ValueError(f"tp_dim {tp_dim!r} is not a mesh dim name; mesh dims are {list(names)}")
    return names.index(tp_dim)


def _generalise(name: str) -> str:
    return r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))


_QKV = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv"}


def _head_dim(attn: nn.Module | None) -> int | None:
    """The head size of an attention module (``head_dim`` / ``head_size``), if it says."""
    for attr in ("head_dim", "head_size"):
        v = getattr(attn, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _linear_dims(mod: nn.Module) -> tuple[int, int, int] | None:
    """(out-feature dim of weight, in_features, out_features) for Linear-like modules."""
    w = getattr(mod, "weight", None)
    if isinstance(mod, nn.Linear):
        return 0, mod.in_features, mod.out_features
    if type(mod).__name__ == "Conv1D" and isinstance(w, nn.Parameter) and w.ndim == 2:
        return 1, w.shape[0], w.shape[1]  # HF Conv1D: weight [in, out]
    return None


def default_sharding_plan(
    model: nn.Module,
    device_mesh: DeviceMesh,
    tp_dim: int | str | None = "tp",
    sequence_parallel: bool = False,
    sequence_dim: int = 1,
) -> dict[str, dict[str, Any]] | None:
    """Derive a Megatron TP(+SP) plan for a transformer-style ``model``.

    Args:
        model: The module (not yet parallelized).
        device_mesh: The mesh; every mesh dim but ``tp_dim`` stays ``Replicate()``.
        tp_dim: Name or index of the tensor-parallel mesh dim.
        sequence_parallel: Keep activations ``Shard(sequence_dim)`` between blocks.
        sequence_dim: The sequence dim of activations (``1`` for ``[batch, seq, hidden]``).

    Returns:
        A plan dict, or ``None`` if nothing in ``model`` looked shardable.
    """
    tp = resolve_tp_dim(device_mesh, tp_dim)
    n = device_mesh.size(tp)

    def on_tp(p):
        out = [Replicate()] * device_mesh.ndim
        out[tp] = p
        return [out]

    def place(p):
        return on_tp(p)[0]

    act = Shard(sequence_dim) if sequence_parallel else Replicate()
    params: dict[str, Any] = {}
    forward: dict[str, Any] = {}

    def put(table: dict, name: str, suffix: str, value: Any) -> None:
        table[(name, suffix)] = value

    modules = dict(model.named_modules())
    shardable = False
    for name, mod in modules.items():
        if not name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        low = leaf.lower()
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if isinstance(mod, nn.Embedding):
            if _POSITION.search(low) or mod.num_embeddings % n:
                continue
            put(params, name, ".weight", place(Shard(0)))
            put(forward, name, ".output", on_tp(act))
            shardable = True
            continue
        if "norm" in type(mod).__name__.lower() or low.startswith(("ln", "norm")):
            if sequence_parallel and not re.search(r"(^|_)(q|k)_?norm$", low):
                put(forward, name, ".output", on_tp(Replicate()))
            continue
        dims = _linear_dims(mod)
        if dims is None:
            continue
        out_dim, fin, fout = dims
        in_dim = 1 - out_dim
        kind = None  # other fused QKV and unknown names stay replicated
        if low in COLWISE:
            kind = "col"
        elif low == "c_attn" and type(mod).__name__ == "Conv1D":
            kind = "fused3"
        elif low in ROWWISE or (low == "dense" and "att" in parent.lower()):
            kind = "row"
        # Attention projections shard whole heads: a head count that does not divide by
        # the tp size (GQA's few key/value heads) leaves the projection replicated.
        head_dim = _head_dim(modules.get(parent))
        if head_dim and low in _QKV:
            if fout % (head_dim * n):
                kind = None
        if kind == "fused3" and head_dim and (fout // 3) % (head_dim * n):
            kind = None
        if kind == "col" and fout % n == 0:
            put(params, name, ".weight", place(Shard(out_dim)))
            if getattr(mod, "bias", None) is not None:
                put(params, name, ".bias", place(Shard(0)))
            if low == "lm_head":
                put(forward, name, ".output", on_tp(Replicate()))
            shardable = True
        elif kind == "fused3" and fout % (3 * n) == 0:
            put(params, name, ".weight", place(_StridedShard(out_dim, split_factor=3)))
            if getattr(mod, "bias", None) is not None:
                put(params, name, ".bias", place(_StridedShard(0, split_factor=3)))
            shardable = True
        elif kind == "row" and fin % n == 0:
            put(params, name, ".weight", place(Shard(in_dim)))
            put(forward, name, ".output", on_tp(act))
            shardable = True
    if not shardable:
        return None
    return {"parameter": _compress(params), "forward": _compress(forward)}


def _compress(entries: dict[tuple[str, str], Any]) -> dict[str, Any]:
    """Turn per-name entries into regex keys, generalising layer indices where all agree."""
    groups: dict[str, list[tuple[str, Any]]] = {}
    for (name, suffix), value in entries.items():
        # ".input"/".output" stay literal: they are the forward-key syntax, not regex.
        sfx = suffix if suffix in (".input", ".output") else re.escape(suffix)
        groups.setdefault(_generalise(name) + sfx, []).append((re.escape(name) + sfx, value))
    out: dict[str, Any] = {}
    for key, items in groups.items():
        if len(items) > 1 and all(v == items[0][1] for _, v in items):
            out[key] = items[0][1]
        else:
            for exact, value in items:
                out[exact] = value
    return out
