"""Pipeline parallelism on ``torch.distributed.pipelining``.

`pipeline_parallelize` splits an unmodified model into stages (`_pipeline_split`),
lets the caller parallelize each stage over the rest of the mesh (TP/SP plans, DDP,
FSDP, HSDP, activation checkpointing: ``DModule(stage, submesh, ...)``), wraps every
stage in torch's ``PipelineStage`` and runs torch's schedules (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``). vescale adds no scheduler of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.dmodule._compat import tree_flatten, tree_unflatten
from vescale.dmodule._pipeline_split import (
    PipelineSplitError,
    auto_split_points,
    build_stage_module,
    check_split_points,
    merge_stage_modules,
    meta_like,
    stage_of_modules,
    stub_ghosts,
    trace_model,
)
from vescale.dtensor.random import is_single_device_rng, microbatch_rng

__all__ = ["PipelineParallel", "pipeline_parallelize", "PipelineSplitError", "SCHEDULES"]

#: Schedule names accepted by `pipeline_parallelize` -> (torch class, stages per rank).
SCHEDULES: dict[str, tuple[type, int]] = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved1f1b": (ScheduleInterleaved1F1B, 2),
}


class _StageExit(Exception):  # noqa: N818 - control flow, never escapes
    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.tensors = tensors


def _plain(t: Any) -> Any:
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclasses.dataclass
class _Runtime:
    """Per-stage state of one forward call."""

    stage_index: int
    num_stages: int
    entry_name: str | None
    exit_name: str | None
    meta_args: tuple = ()
    received: tuple | None = None
    entered: bool = False
    idmap: dict = dataclasses.field(default_factory=dict)
    keep: list = dataclasses.field(default_factory=list)
    mesh: DeviceMesh | None = None  # the stage's DModule mesh: received tensors join it
    # one-device randomness (see `_RandomState`): the micro-batch running, how many
    rng: _RandomState | None = None
    chunk: int = 0
    microbatches: int = 1

    def lift(self, t: torch.Tensor) -> torch.Tensor:
        """A received tensor as the stage's model sees its activations.

        In a module parallelized by ``DModule`` activations are DTensors (their data
        parallel dims ``Replicate()``, as DModule's own plans place them); a plain
        activation meeting DTensor weights would work in forward (implicit
        replication) but not in backward. ``Replicate()`` on every dim: the plans of
        the modules inside redistribute as they would any input.
        """
        if self.mesh is None or isinstance(t, DTensor) or not t.is_floating_point():
            return t
        return DTensor.from_local(t, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)

    def substitute(self, leaves: list[Any]) -> list[Any]:
        out = []
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.device.type == "meta" and id(x) in self.idmap:
                x = self.idmap[id(x)]
            out.append(x)
        return out


def _entry_hook(rt: _Runtime, name: str) -> Callable:
    def hook(_mod: nn.Module, args: tuple, kwargs: dict):
        if rt.received is None:
            return None
        leaves, spec = tree_flatten((args, kwargs))
        if name == rt.entry_name and not rt.entered:
            pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            if len(pos) != len(rt.received):
                raise PipelineSplitError(
                    f"stage {rt.stage_index} begins at {name!r}, which was called with "
                    f"{len(pos)} tensors, but {len(rt.received)} were received"
                )
            for i, r in zip(pos, rt.received):
                r = rt.lift(r)
                rt.idmap[id(leaves[i])] = r
                rt.keep.append(leaves[i])
                leaves[i] = r
            rt.entered = True
        elif rt.idmap:
            leaves = rt.substitute(leaves)
        else:
            return None
        return tree_unflatten(leaves, spec)

    return hook


def _exit_hook(rt: _Runtime, name: str) -> Callable:
    def hook(_mod: nn.Module, args: tuple, kwargs: dict):
        leaves, _ = tree_flatten((args, kwargs))
        leaves = rt.substitute(leaves) if rt.idmap else leaves
        tensors = tuple(_plain(x) for x in leaves if isinstance(x, torch.Tensor))
        for t in tensors:
            if t.device.type == "meta":
                raise PipelineSplitError(
                    f"stage {rt.stage_index} ends where {name!r} begins, but one of the tensors "
                    f"{name!r} receives was computed before stage {rt.stage_index}'s first module "
                    "from values other than those received; a stage may only use what the "
                    "previous stage sends (the arguments of its first module)"
                )
        raise _StageExit(tuple(t.contiguous() for t in tensors))

    return hook


class _RandomState:
    """One device's random-number stream through the stages of a pipeline.

    One device runs every random op of a step on the whole batch, stage after stage.
    Stage ``s`` starts drawing from the generator state one device has after stages
    ``0 .. s-1``: stage 0 from the state at the step's start, later stages from the
    state that travels with the activations they receive (an extra tensor after
    them, the state's bytes as float32). Every micro-batch restarts from that state and draws the whole
    batch's values, keeping its own rows (`vescale.dtensor.random.microbatch_rng`),
    so masks equal the whole batch's. After the step every rank takes the state the
    last stage ended with (one broadcast over the ``pp`` group): where one device
    would be.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start: torch.Tensor | None = None  # this step's state before stage 0
        self.end: torch.Tensor | None = None  # the last stage's state after its draws

    def get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device).to(self.device)
        return torch.get_rng_state()

    def carried(self) -> torch.Tensor:
        """The state as it travels between stages: its bytes as float32 values (exact).

        A float, because some torch releases make every received tensor require a
        gradient (and expect one back); see `_tie`.
        """
        return self.get().to(torch.float32)

    def set(self, state: torch.Tensor) -> None:
        state = state.detach().to("cpu", torch.uint8)
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)


def _tie(args: tuple, state: torch.Tensor) -> tuple:
    """``args`` with the received generator state joined to the autograd graph by an exact
    zero, so the stage sends the previous one a (zero) gradient for it as for any
    received tensor (torch 2.11's stages require one for every received tensor)."""
    if not (torch.is_grad_enabled() and state.requires_grad):
        return args
    out = list(args)
    for i, a in enumerate(out):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad:
            out[i] = a + state.sum() * 0.0
            break
    return tuple(out)


def _install_forward(shell: nn.Module, rt: _Runtime, orig_forward: Callable) -> None:
    is_first = rt.stage_index == 0
    is_last = rt.stage_index == rt.num_stages - 1

    def forward(*args: Any, **kwargs: Any) -> Any:
        rng = rt.rng
        if rng is None:
            return run(args, kwargs)
        if is_first:
            if rng.start is None:
                raise RuntimeError("a pipeline stage ran outside PipelineParallel.step")
            state = rng.start
        else:  # the generator state travels after the activations
            state, args = args[-1], _tie(args[:-1], args[-1])
        rng.set(state)
        with microbatch_rng(rt.chunk, rt.microbatches):
            out = run(args, kwargs)
        if is_last:
            rng.end = rng.get()
            return out
        return (*out, rng.carried())

    def run(args: tuple, kwargs: dict) -> Any:
        if is_first:
            call_args, rt.received = args, None
        else:
            call_args, rt.received = meta_like(rt.meta_args), tuple(args)
        rt.entered = False
        try:
            out = orig_forward(shell, *call_args, **kwargs)
        except _StageExit as done:
            return done.tensors
        finally:
            rt.received, rt.entered = None, False
            rt.idmap.clear()
            rt.keep.clear()
        if not is_last:
            raise PipelineSplitError(
                f"stage {rt.stage_index}'s forward returned without reaching {rt.exit_name!r}, "
                "where the next stage begins"
            )
        leaves, spec = tree_flatten(out)
        leaves = [_plain(x) for x in leaves]
        if any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in leaves):
            raise PipelineSplitError(
                "the model's output on the last stage depends on a value computed before the "
                "last stage's first module that was not sent to it"
            )
        return tree_unflatten(leaves, spec)

    shell.__dict__["forward"] = forward


class _Stage(PipelineStage):
    """torch's ``PipelineStage``; backward passes of all but the last micro-batch of a
    step accumulate gradients without data-parallel communication (`no_sync`). The
    stage's forward learns which micro-batch it runs (one-device randomness), and
    backward passes run in that micro-batch's random region too, so activation
    checkpointing recomputes the forward's masks."""

    _vescale_rt: _Runtime

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        self._vescale_rt.chunk = fwd_chunk_id
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False
    ):  # noqa: E501
        from vescale.dmodule._fsdp import no_sync

        rt = self._vescale_rt
        with contextlib.ExitStack() as stack:
            if not last_backward:
                stack.enter_context(no_sync(self.submod))
            if rt.rng is not None:
                stack.enter_context(microbatch_rng(bwd_chunk_id, rt.microbatches))
            return super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )


def _mesh_parts(mesh: DeviceMesh, pp_dim: str) -> tuple[int, int, Any, DeviceMesh | None]:
    names = tuple(mesh.mesh_dim_names or ())
    if pp_dim not in names:
        raise ValueError(
            f"the device mesh has no dim named {pp_dim!r} (its dims: {names or 'unnamed'}); "
            "name the pipeline dim, e.g. init_device_mesh(..., mesh_dim_names=('pp', 'dp'))"
        )
    rest = tuple(n for n in names if n != pp_dim)
    submesh = mesh[rest] if rest else None
    return (
        mesh.get_local_rank(pp_dim),
        mesh.size(names.index(pp_dim)),
        mesh.get_group(pp_dim),
        submesh,
    )


class PipelineParallel:
    """An unmodified model split into pipeline stages over the ``pp`` dim of a mesh.

    Made by `pipeline_parallelize`. Each rank holds ``stages_per_rank`` stages
    (``model_parts``); every stage module is the model's own class, holding that
    stage's submodules under the unmodified model's names, so ``named_parameters()``
    and ``state_dict()`` keys carry no stage prefix and checkpoints move between
    pipeline layouts.

    Attributes:
        module: One ``nn.Module`` with this rank's parameters and buffers under the
            unmodified model's names: the stage module itself with one stage per rank,
            else a container of the stages' submodules. Give it to optimizers and to
            ``vescale.checkpoint`` (``{"model": pp.module, "optimizer": opt}``); never
            call it.
        model_parts: This rank's stage modules (one, or two for interleaved 1F1B).
        stage_indices: Their stage indices (rank ``r`` holds ``r, r + p, ...``).
        num_stages: Total number of stages.
        split_points: Module names where stages ``1 .. num_stages - 1`` begin.
        microbatches: Micro-batches per `step`.
        schedule: torch's schedule object.
        submesh: The mesh without the ``pp`` dim that stages were parallelized over
            (``None`` for a 1-D mesh).
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        stages: list[PipelineStage],
        schedule: Any,
        *,
        num_stages: int,
        split_points: list[str],
        microbatches: int,
        pp_group: Any,
        submesh: DeviceMesh | None,
        rng: _RandomState | None = None,
    ) -> None:
        self._rng = rng
        self.model_parts = model_parts
        self.stages = stages
        self.schedule = schedule
        self.num_stages = num_stages
        self.stage_indices = [s.stage_index for s in stages]
        self.split_points = split_points
        self.microbatches = microbatches
        self.pp_group = pp_group
        self.submesh = submesh
        self.module = merge_stage_modules(model_parts)

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank holds stage 0 (the one that takes the inputs)."""
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank holds the last stage (the one that computes the loss)."""
        return self.num_stages - 1 in self.stage_indices

    def step(
        self, *inputs: torch.Tensor, target: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """One forward and backward of a batch, split into ``microbatches`` along dim 0.

        Every rank calls it with the same arguments (ranks without the first stage may
        pass ``None`` inputs... but the batch shape must be the one given at
        construction). Gradients accumulate into ``.grad`` as for
        ``loss.backward()`` on the whole batch with a mean over micro-batches.

        Args:
            *inputs: The model's positional inputs for the whole batch (used by the
                first stage).
            target: The loss target for the whole batch (used by the last stage).

        Returns:
            On ranks holding the last stage, the loss: the mean of the micro-batch
            losses (a detached 0-dim tensor). ``None`` elsewhere.
        """
        return self._run_schedule(self.schedule.step, inputs, target)

    def _run_schedule(
        self, run: Callable[..., Any], inputs: tuple, target: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``run`` (``schedule.step`` or ``schedule.eval``) on this rank's stages' share of
        the batch; the summed detached micro-batch losses on ranks with the last stage."""
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        args = inputs if self.has_first_stage else ()
        tgt = target if self.has_last_stage else None
        with self._random_stream():
            run(*args, target=tgt, losses=losses)
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()

    @property
    def single_device_rng(self) -> bool:
        """Whether random ops in the stages draw one device's values (the model runs
        random ops and `vescale.dtensor.random.is_single_device_rng` was on when the
        pipeline was built)."""
        return self._rng is not None

    @contextlib.contextmanager
    def _random_stream(self) -> Iterator[None]:
        rng = self._rng
        if rng is None:
            yield
            return
        rng.start, rng.end = rng.get(), None
        try:
            yield
        finally:
            rng.start = None
        # every rank continues from where one device would be: the last stage's state
        last = (self.num_stages - 1) % dist.get_world_size(self.pp_group)
        state = rng.end if self.has_last_stage else rng.get()
        dist.broadcast(state, src=dist.get_global_rank(self.pp_group, last), group=self.pp_group)
        rng.set(state)

    @torch.no_grad()
    def eval_step(
        self, *inputs: torch.Tensor, target: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward only (torch's ``schedule.eval``): the mean micro-batch loss, no gradients.

        Same arguments and return value as `step`.
        """
        return self._run_schedule(self.schedule.eval, inputs, target)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of this rank's stages."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of this rank's stages, under the unmodified model's names."""
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages' state, keyed by the unmodified model's names."""
        return self.module.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` of every local stage."""
        for m in self.model_parts:
            m.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model (all stages) by their total norm.

        Each stage's norm is computed by `vescale.optim.get_total_norm` (any
        placements over the stage's mesh), then combined over the ``pp`` group, so every
        rank gets the norm of the whole model and scales its own gradients.

        Returns:
            The total norm of the whole model's gradients (before clipping).
        """
        from vescale.optim import clip_grads_with_norm_, get_total_norm

        p = float(norm_type)
        grads = [q.grad for q in self.parameters() if q.grad is not None]
        local = get_total_norm(grads, p) if grads else torch.zeros(())
        local = local.to(torch.float64)
        if p == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.pp_group)
            total = local
        else:
            local = local**p
            dist.all_reduce(local, group=self.pp_group)
            total = local ** (1.0 / p)
        total = total.to(torch.float32)
        clip_grads_with_norm_(grads, max_norm, total)
        return total


def _schedule_key(schedule: str) -> str:
    key = schedule.lower().replace("-", "").replace("_", "").replace(" ", "")
    key = {"interleaved": "interleaved1f1b", "1f1binterleaved": "interleaved1f1b"}.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; choose one of 'gpipe', '1f1b', "
            "'interleaved1f1b'"
        )
    return key


def pipeline_parallelize(
    model: nn.Module,
    device_mesh: DeviceMesh,
    *,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    microbatches: int,
    schedule: str = "1f1b",
    pp_dim: str = "pp",
    split_points: Sequence[str] | None = None,
    stages_per_rank: int | None = None,
    parallelize_fn: Callable[[nn.Module, DeviceMesh | None], nn.Module | None] | None = None,
    src_data_rank: int | None = 0,
) -> PipelineParallel:
    """Split ``model`` into pipeline stages over ``device_mesh[pp_dim]`` and build a schedule.

    The model is not modified: each stage is a shell of the model's own class holding
    that stage's submodules (the model's tensors are moved, not copied; keep using the
    returned object, not ``model``). Stages begin at ``split_points`` (module names
    called once per forward, in forward order) or, by default, at blocks of the
    model's largest ``nn.ModuleList`` chosen to balance parameter counts. The modules
    called before the first split point (embeddings) join stage 0, those after the
    last block (final norm, head) the last stage. Only the tensor arguments of a
    stage's first module travel between stages.

    Args:
        model: The unmodified single-device model (real or meta tensors).
        device_mesh: A mesh with a dim named ``pp_dim``; the other dims form the
            submesh each stage is parallelized over.
        example_inputs: The model's positional inputs for one whole batch (shapes and
            dtypes only; every `PipelineParallel.step` takes a batch of this shape).
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, a mean over its samples;
            the step's loss is the mean over micro-batches (equal to ``loss_fn`` of the
            whole batch when the batch splits evenly).
        microbatches: Micro-batches per step; must divide the batch size.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved1f1b"``.
        pp_dim: Name of the pipeline mesh dim.
        split_points: Module names where stages 1, 2, ... begin (``None``: automatic).
        stages_per_rank: Stages per rank (default 1; 2 for interleaved 1F1B, which
            needs at least 2).
        parallelize_fn: ``fn(stage_module, submesh)`` called once per local stage
            before the pipeline is built, e.g.
            ``lambda m, mesh: DModule(m, mesh, plan, data_parallel={"dp": "fsdp"})``.
        src_data_rank: The ``pp`` coordinate whose model values every stage takes:
            before the split, that rank sends each other pipeline rank the parameters
            and buffers of the stages it holds (point-to-point over the ``pp`` group,
            about ``(pp-1)/pp`` of the model's bytes from the source, each rank
            receiving only its stages; meta tensors are skipped). ``parallelize_fn``
            then distributes within the submesh (``DModule``'s own ``src_data_rank``),
            so ranks seeded differently train the source rank's model. ``None``:
            each stage keeps the values of the rank that holds it (no communication).

    Returns:
        The `PipelineParallel` runner.
    """
    key = _schedule_key(schedule)
    schedule_cls, default_v = SCHEDULES[key]
    if src_data_rank is not None and (
        isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int)
    ):
        raise TypeError(f"src_data_rank must be an int or None, got {src_data_rank!r}")
    v = default_v if stages_per_rank is None else int(stages_per_rank)
    if v < 1 or (key != "interleaved1f1b" and v != 1):
        raise ValueError(
            f"schedule {schedule!r} runs one stage per rank, got stages_per_rank={v}; "
            "use 'interleaved1f1b' for more"
        )
    if key == "interleaved1f1b" and v < 2:
        raise ValueError("interleaved 1F1B needs stages_per_rank >= 2")
    inputs = tuple(example_inputs)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError("example_inputs must be a non-empty sequence of tensors (one batch)")
    m = int(microbatches)
    batch = inputs[0].shape[0]
    if m < 1 or batch % m:
        raise ValueError(
            f"microbatches={microbatches} must be >= 1 and divide the batch size {batch} "
            "(every micro-batch has the same shape)"
        )
    pp_rank, pp_size, pp_group, submesh = _mesh_parts(device_mesh, pp_dim)
    if src_data_rank is not None and not 0 <= src_data_rank < pp_size:
        raise ValueError(
            f"src_data_rank={src_data_rank} is not a rank of the {pp_dim!r} dim (size {pp_size})"
        )
    n = pp_size * v
    if key == "1f1b" and m < n:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages: microbatches={m}, {n} stages"
        )
    if key == "interleaved1f1b" and m % pp_size:
        raise ValueError(
            f"interleaved 1F1B needs microbatches ({m}) to be a multiple of the pipeline "
            f"size ({pp_size})"
        )
    mb_args = tuple(t[: batch // m] for t in inputs)
    with microbatch_rng(0, 1) as seen:  # counts the model's random ops (on meta)
        trace = trace_model(model, mb_args, {})
    if split_points is None:
        points = auto_split_points(model, n) if n > 1 else []
    else:
        points = list(split_points)
    points = check_split_points(model, points, trace, n)
    owner = stage_of_modules(model, points, trace)
    if src_data_rank is not None:
        _send_stage_values(model, owner, pp_rank, pp_size, pp_group, src_data_rank)

    out_leaves, _ = tree_flatten(trace.output)
    if not out_leaves or not all(isinstance(x, torch.Tensor) for x in out_leaves):
        raise PipelineSplitError("the model's output must be a tensor or a tuple of tensors")

    device = torch.device(device_mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rng = _RandomState(device) if seen.random_ops and is_single_device_rng() else None
    carried = (rng.carried(),) if rng is not None else ()  # the generator state's shape

    def stage_io(s: int) -> tuple[tuple, tuple]:
        ins = mb_args if s == 0 else (*trace.arg_leaves[points[s - 1]], *carried)
        outs = tuple(out_leaves) if s == n - 1 else (*trace.arg_leaves[points[s]], *carried)
        return ins, outs

    parts: list[nn.Module] = []
    stages: list[PipelineStage] = []
    orig_forward = type(model).forward
    for s in range(pp_rank, n, pp_size):
        built = build_stage_module(model, s, owner)
        part = built.module
        rt = _Runtime(
            stage_index=s,
            num_stages=n,
            entry_name=points[s - 1] if s > 0 else None,
            exit_name=points[s] if s < n - 1 else None,
            meta_args=mb_args,
            rng=rng,
            microbatches=m,
        )
        _install_forward(part, rt, orig_forward)
        stub_ghosts(built.ghosts, trace, rt.exit_name)
        if parallelize_fn is not None:
            res = parallelize_fn(part, submesh)
            if res is not None and res is not part:
                raise TypeError(
                    "parallelize_fn must parallelize the stage module in place (DModule, "
                    "fully_shard and replicate do) and return it or None"
                )
        rt.mesh = _tensor_parallel_mesh(part)
        if s > 0:
            for name, mod in built.entry_modules.items():
                mod.register_forward_pre_hook(_entry_hook(rt, name), prepend=True, with_kwargs=True)
            if rt.entry_name not in built.entry_modules:
                raise PipelineSplitError(
                    f"split point {rt.entry_name!r} is not wholly on stage {s}"
                )
        if s < n - 1:
            exit_mod = _find_ghost(built.ghosts, rt.exit_name)
            exit_mod.register_forward_pre_hook(_exit_hook(rt, rt.exit_name), with_kwargs=True)
        ins, outs = stage_io(s)
        stage = _Stage(
            part,
            s,
            n,
            device,
            input_args=tuple(_example(t, device) for t in ins),
            output_args=tuple(_example(t, device) for t in outs),
            group=pp_group,
        )
        stage._vescale_rt = rt
        parts.append(part)
        stages.append(stage)

    def scaled_loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return loss_fn(out, tgt) / m

    if key == "interleaved1f1b":
        sched = schedule_cls(stages, n_microbatches=m, loss_fn=scaled_loss, scale_grads=False)
    else:
        sched = schedule_cls(stages[0], n_microbatches=m, loss_fn=scaled_loss, scale_grads=False)
    return PipelineParallel(
        parts,
        stages,
        sched,
        num_stages=n,
        split_points=points,
        microbatches=m,
        pp_group=pp_group,
        submesh=submesh,
        rng=rng,
    )


def _send_stage_values(
    model: nn.Module,
    owner: dict[str, int],
    pp_rank: int,
    pp_size: int,
    pp_group: Any,
    src: int,
) -> None:
    """Every pipeline rank's stages take the values of pp rank ``src``'s model.

    Stage ``s`` lives on pp rank ``s % pp_size``; rank ``src`` sends it the tensors of
    that stage's modules (``owner``: module name -> stage), the owner receives them in
    place. Ranks neither ``src`` nor the owner take no part in a transfer.
    """
    if pp_size == 1:
        return
    ops: list[Any] = []
    seen: set[int] = set()
    for name, mod in model.named_modules(remove_duplicate=False):
        s = owner.get(name)
        if s is None or s % pp_size == src or pp_rank not in (src, s % pp_size):
            continue
        peer = dist.get_global_rank(pp_group, s % pp_size if pp_rank == src else src)
        for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
            if id(t) in seen or t.device.type == "meta":
                continue
            seen.add(id(t))
            if not t.is_contiguous():
                raise ValueError(
                    f"pipeline_parallelize: {name}'s tensor of shape {tuple(t.shape)} is not "
                    "contiguous; src_data_rank sends it in place (make it contiguous, or pass "
                    "src_data_rank=None)"
                )
            op = dist.isend if pp_rank == src else dist.irecv
            ops.append(dist.P2POp(op, t.detach(), peer, group=pp_group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _tensor_parallel_mesh(module: nn.Module) -> DeviceMesh | None:
    """The mesh on which ``module``'s activations are DTensors, if any.

    That is the mesh of its tensor-parallel (``Shard``) parameters or, without those,
    of parameters that are all ``Replicate()`` DTensors on every dim (``DModule``
    without data-parallel engine, e.g. for ``DistributedOptimizer``): there the model's
    activations are DTensors (``DModule``'s plans and implicit replication make them),
    so the tensors a stage receives become DTensors on that mesh. Data parallelism by
    DDP or FSDP keeps activations plain.
    """
    replicated, only_replicated = None, True
    for p in module.parameters():
        if not isinstance(p, DTensor):
            continue
        if any(isinstance(pl, Shard) for pl in p.placements):
            return _compute_mesh(p)
        if all(isinstance(pl, Replicate) for pl in p.placements):
            replicated = replicated or p.device_mesh
        else:  # e.g. FSDP's flat shards: the engine gathers them, activations stay plain
            only_replicated = False
    return replicated if only_replicated else None


def _compute_mesh(p: DTensor) -> DeviceMesh:
    """The mesh a tensor-parallel parameter computes on: its mesh without the dims of
    a data-parallel engine's own placements (FSDP's flat shards), where the engine
    hands the forward the unsharded parameter."""
    mesh = p.device_mesh
    names = mesh.mesh_dim_names
    keep = [i for i, pl in enumerate(p.placements) if isinstance(pl, (Shard, Replicate, Partial))]
    if not names or len(keep) == mesh.ndim or not keep:
        return mesh
    return mesh[tuple(names[i] for i in keep)]


def _example(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    return out.requires_grad_(t.requires_grad) if out.is_floating_point() else out


def _find_ghost(ghosts: dict[str, nn.Module], name: str) -> nn.Module:
    for gname, g in ghosts.items():
        if name == gname:
            return g
        if name.startswith(gname + "."):
            return g.get_submodule(name[len(gname) + 1 :])
    raise PipelineSplitError(f"split point {name!r} is not a module of another stage")
