"""The conformance matrix: every engine x every training-loop idiom vs one device.

An *idiom* is a training loop written the way users write it (``loss = model(x, y)``,
``opt.zero_grad()`` wherever they put it, ``.grad`` read and changed between backward
and step, frozen parameters, state-dict round trips, ...). It runs twice with the same
seed and the same global batches: once on a plain single-device model with a plain
``torch.optim`` optimizer (the reference), once on the model parallelized by an
*engine* (DDP, FSDP, TP, ...), where each data-parallel rank gets its slice of every
global batch. The loop records what a user would look at (losses, the ``.grad`` they
read, the parameters) through ``u.check``; the records must agree to 1e-5.

The idiom code is the user's code: it gets a :class:`User` whose ``model``,
``optimizer()``, ``batches`` and ``no_sync()`` are the plain PyTorch objects on the
reference side and vescale's on the engine side, nothing else.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vescale.dmodule import DModule, no_sync
from vescale.dmodule.testing import Block, GPTConfig
from vescale.dtensor import DTensor, Replicate, init_device_mesh
from vescale.optim import DistributedOptimizer, Muon
from vescale.optim import clip_grad_norm_ as vescale_clip_grad_norm_

WORLD = 4
STEPS = 3
GLOBAL_BATCH = 8
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.0)
LR = 1e-2
WD = 0.1
TOL = dict(atol=1e-5, rtol=1e-5)
MUON_TOL = dict(atol=2e-3, rtol=1e-2)  # bf16 roundings of lr-sized updates


# --------------------------------------------------------------------------- the model
class LM(nn.Module):
    """A tiny GPT-style language model as users write one.

    ``forward(idx, targets=None)`` returns the mean cross-entropy when given targets,
    else the logits. ``extra`` is a residual branch that runs only while
    ``use_extra`` is set (a parameter unused in some steps).
    """

    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.extra = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.use_extra = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        if self.use_extra:
            x = x + torch.tanh(self.extra(x))
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, self.cfg.vocab_size), targets.reshape(-1))


@dataclasses.dataclass
class Batch:
    idx: torch.Tensor
    targets: torch.Tensor


class DictLM(LM):
    """``model({"idx": ..., "targets": ...})``: one dict argument."""

    def forward(self, batch: dict) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch["idx"], targets=batch["targets"])


class TupleLM(LM):
    """``model((idx, targets))``: one tuple argument."""

    def forward(self, pair: tuple) -> torch.Tensor:  # type: ignore[override]
        return super().forward(pair[0], targets=pair[1])


class DataclassLM(LM):
    """``model(Batch(idx, targets))``: one dataclass argument."""

    def forward(self, batch: Batch) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch.idx, targets=batch.targets)


def global_batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


# --------------------------------------------------------------------------- the user
def _value(t: Any) -> Any:
    """What a user sees of a tensor: the global value (DTensors gathered)."""
    if isinstance(t, DTensor):  # full_tensor() may alias the local tensor: copy it
        return t.detach().full_tensor().clone()
    if isinstance(t, torch.Tensor):
        return t.detach().clone()
    return t


class User:
    """What an idiom's loop gets: the model, its optimizer and the data, nothing else.

    Attributes:
        model: The model (plain, or parallelized by the engine).
        batches: The global batches, sliced to this rank's data-parallel share.
        records: ``(label, value)`` pairs recorded by :meth:`check`.
    """

    def __init__(self, model: nn.Module, side: Side) -> None:
        self.model = model
        self.side = side
        self.batches = [(side.local(x), side.local(y)) for x, y in global_batches()]
        self.records: list[tuple[str, Any]] = []

    # the user's objects -------------------------------------------------------
    def optimizer(self, params: Any, **kw: Any) -> Any:
        """The optimizer of the engine (AdamW, or Muon / DistributedOptimizer)."""
        kw.setdefault("lr", LR)
        kw.setdefault("weight_decay", WD)
        return self.side.optimizer(self.model, params, **kw)

    def no_sync(self) -> Any:
        return self.side.no_sync(self.model)

    # what the user looks at ---------------------------------------------------
    def check(self, label: str, value: Any) -> None:
        """Record ``value`` (a tensor, a number, or a dict of them) as the user sees it."""
        if isinstance(value, dict):
            value = {k: self._global(v) for k, v in value.items()}
        else:
            value = self._global(value)
        self.records.append((label, value))

    def _global(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.ndim == 0 and v.requires_grad:
            # a loss: each data-parallel rank has its own; the user logs their mean
            return self.side.mean_over_data(_value(v))
        return _value(v)

    def grads(self) -> dict[str, Any]:
        return {n: p.grad for n, p in self.model.named_parameters()}

    def params(self) -> dict[str, Any]:
        return {n: p for n, p in self.model.named_parameters()}


# --------------------------------------------------------------------------- the sides
class Side:
    """The reference: one device, plain PyTorch."""

    def wrap(self, model: nn.Module, idiom: Idiom) -> nn.Module:
        return model

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def mean_over_data(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def no_sync(self, model: nn.Module) -> Any:
        return contextlib.nullcontext()

    def optimizer(self, model: nn.Module, params: Any, **kw: Any) -> Any:
        return torch.optim.AdamW(params, **kw)


class MuonReference(Side):
    def optimizer(self, model: nn.Module, params: Any, **kw: Any) -> Any:
        return _muon(model, params, **kw)


def _muon(model: nn.Module, params: Any, **kw: Any) -> Muon:
    params = list(params)
    if params and not isinstance(params[0], dict):
        names = {id(p): n for n, p in model.named_parameters()}
        matrices = [p for p in params if p.ndim == 2 and not _adamw_name(names[id(p)])]
        others = [p for p in params if not any(p is m for m in matrices)]
        params = [{"params": matrices, "use_muon": True}, {"params": others, "use_muon": False}]
        params = [g for g in params if g["params"]]
    return Muon(
        params, momentum=0.9, adamw_lr=kw["lr"], adamw_weight_decay=kw["weight_decay"], **kw
    )


def _adamw_name(name: str) -> bool:
    return any(k in name for k in ("wte", "wpe", "lm_head"))


@dataclasses.dataclass
class Engine(Side):
    """One way of parallelizing the model (see ``ENGINES``)."""

    name: str
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    data_dims: tuple[str, ...] = ()  # mesh dims the global batch is split over
    plan: dict | None = None  # None: the automatic plan
    optim: str = "adamw"  # "adamw", "zero1", "zero2" or "muon"
    tensor_parallel: bool = False
    mesh: Any = None
    # Muon orthogonalizes in bf16 (as torch.optim.Muon): a last-bit difference in a
    # gradient (a sum in another order) can flip a bf16 rounding of the update
    tol: dict = dataclasses.field(default_factory=lambda: dict(TOL))

    def wrap(self, model: nn.Module, idiom: Idiom) -> nn.Module:
        key = (self.mesh_shape, self.mesh_names)
        if key not in MESHES:
            MESHES[key] = init_device_mesh("cpu", self.mesh_shape, mesh_dim_names=self.mesh_names)
        self.mesh = MESHES[key]
        plan = self.plan
        opts = dict(self.options)
        if idiom.plan is not None:
            plan = idiom.plan
            opts["auto_plan"] = self.tensor_parallel
        return DModule(model, self.mesh, plan, **opts)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        n, r = self._data_rank()
        k = t.shape[0] // n
        return t[r * k : (r + 1) * k]

    def _data_rank(self) -> tuple[int, int]:
        n, r = 1, 0
        for d in self.data_dims:
            n, r = (
                n * self.mesh.size(self.mesh_names.index(d)),
                r * self.mesh.size(self.mesh_names.index(d)) + self.mesh.get_local_rank(d),
            )
        return n, r

    def mean_over_data(self, v: torch.Tensor) -> torch.Tensor:
        n, _ = self._data_rank()
        if n == 1:
            return v
        v = v.clone()
        for d in self.data_dims:
            dist.all_reduce(v, group=self.mesh.get_group(d))
        return v / n

    def no_sync(self, model: nn.Module) -> Any:
        return no_sync(model)

    def optimizer(self, model: nn.Module, params: Any, **kw: Any) -> Any:
        if self.optim == "muon":
            return _muon(model, params, **kw)
        if self.optim in ("zero1", "zero2"):
            return DistributedOptimizer(
                list(params),
                torch.optim.AdamW,
                mesh=self.mesh,
                dp_dim="dp",
                model=model,
                zero_stage=int(self.optim[-1]),
                **kw,
            )
        return torch.optim.AdamW(params, **kw)


#: Meshes of the current pool task (its process groups die with the task: clear first).
MESHES: dict[tuple, Any] = {}

REPLICATE_PLAN: dict = {}  # an explicit empty plan: every parameter Replicate()

ENGINES: dict[str, Engine] = {
    e.name: e
    for e in [
        Engine("none", (4,), ("dp",), plan=REPLICATE_PLAN),
        Engine("ddp", (4,), ("dp",), {"data_parallel": {"dp": "ddp"}}, ("dp",)),
        Engine("fsdp", (4,), ("dp",), {"data_parallel": {"dp": "fsdp"}}, ("dp",)),
        Engine(
            "fsdp-noreshard",
            (4,),
            ("dp",),
            {"data_parallel": {"dp": {"mode": "fsdp", "reshard_after_forward": False}}},
            ("dp",),
        ),
        Engine(
            "hsdp",
            (2, 2),
            ("rep", "shard"),
            {"data_parallel": {"rep": "ddp", "shard": "fsdp"}},
            ("rep", "shard"),
        ),
        Engine("tp", (4,), ("tp",), tensor_parallel=True),
        Engine("tp-sp", (4,), ("tp",), {"sequence_parallel": True}, tensor_parallel=True),
        Engine(
            "ddp-tp",
            (2, 2),
            ("dp", "tp"),
            {"data_parallel": {"dp": "ddp"}},
            ("dp",),
            tensor_parallel=True,
        ),
        Engine(
            "fsdp-tp",
            (2, 2),
            ("dp", "tp"),
            {"data_parallel": {"dp": "fsdp"}},
            ("dp",),
            tensor_parallel=True,
        ),
        Engine("zero1", (4,), ("dp",), data_dims=("dp",), plan=REPLICATE_PLAN, optim="zero1"),
        Engine("zero2", (4,), ("dp",), data_dims=("dp",), plan=REPLICATE_PLAN, optim="zero2"),
        Engine(
            "muon-fsdp",
            (4,),
            ("dp",),
            {"data_parallel": {"dp": "fsdp"}},
            ("dp",),
            optim="muon",
            tol=MUON_TOL,
        ),
        Engine("muon-tp", (4,), ("tp",), optim="muon", tensor_parallel=True, tol=MUON_TOL),
    ]
}


# --------------------------------------------------------------------------- idioms
@dataclasses.dataclass
class Idiom:
    name: str
    loop: Callable[[User], None]
    doc: str
    model_cls: type[nn.Module] = LM
    plan: dict | None = None  # a plan the user gives (engines with tensor parallelism)
    freeze_before_wrap: Callable[[nn.Module], None] | None = None
    needs_tp: bool = False
    needs_param_groups: bool = False  # the engine's optimizer must take param groups


IDIOMS: dict[str, Idiom] = {}


def idiom(doc: str, **kw: Any):
    def deco(fn: Callable[[User], None]) -> Callable[[User], None]:
        name = fn.__name__.replace("_", "-")
        IDIOMS[name] = Idiom(name, fn, doc, **kw)
        return fn

    return deco


def _step(u: User, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = u.model(x, y)
    loss.backward()
    u.check("grad", u.grads())
    opt.step()
    opt.zero_grad()
    u.check("loss", loss)


@idiom("`opt.zero_grad()` before the forward")
def zero_grad_before(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        opt.zero_grad()
        loss = u.model(x, y)
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        u.check("loss", loss)


@idiom("`loss = model(x)`, then `opt.zero_grad()`, then `loss.backward()`")
def zero_grad_after_forward(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(x, y)
        opt.zero_grad()
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        u.check("loss", loss)


@idiom("`opt.zero_grad(set_to_none=False)`")
def zero_grad_keep(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        opt.zero_grad(set_to_none=False)
        loss = u.model(x, y)
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        u.check("loss", loss)


@idiom("no `zero_grad()` in one step: gradients of two steps add up")
def no_zero_grad_once(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for i, (x, y) in enumerate(u.batches):
        if i != 1:
            opt.zero_grad()
        loss = u.model(x, y)
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        u.check("loss", loss)


@idiom("two micro-batches, the first under `no_sync`")
def accumulate_no_sync(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        (x1, x2), (y1, y2) = x.chunk(2), y.chunk(2)
        with u.no_sync():
            first = u.model(x1, y1) / 2
            first.backward()
        loss = u.model(x2, y2) / 2
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()
        u.check("loss", first.detach() + loss)


@idiom("two micro-batches, each backward synchronising")
def accumulate(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        total = 0.0
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            loss = u.model(xm, ym) / 2
            loss.backward()
            total = total + loss
        # (a micro-batch holds other samples on each data-parallel rank than on one
        # device, so only the sums over both are comparable)
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()
        u.check("loss", total)


@idiom("log every `p.grad.norm()` between backward and step")
def log_grad_norms(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(x, y)
        loss.backward()
        u.check("norms", {n: p.grad.norm() for n, p in u.model.named_parameters()})
        opt.step()
        opt.zero_grad()


@idiom("`torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)`")
def clip_torch(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(x, y)
        loss.backward()
        u.check("norm", torch.nn.utils.clip_grad_norm_(u.model.parameters(), 0.05))
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()


@idiom("`vescale.optim.clip_grad_norm_(model.parameters(), 0.05)`")
def clip_vescale(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(x, y)
        loss.backward()
        u.check("norm", vescale_clip_grad_norm_(u.model.parameters(), 0.05))
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()


@idiom("scale every `.grad` in place (`p.grad.mul_(0.5)`) before the step")
def scale_grads(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(x, y)
        loss.backward()
        for p in u.model.parameters():
            p.grad.mul_(0.5)
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()


@idiom("loss scaling: `(loss * 1024).backward()`, then `p.grad.div_(1024)` (GradScaler-style)")
def unscale(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(x, y)
        (loss * 1024.0).backward()
        for p in u.model.parameters():
            if p.grad is not None:
                p.grad.div_(1024.0)
        finite = all(torch.isfinite(p.grad).all() for p in u.model.parameters())
        u.check("finite", torch.tensor(bool(finite)))
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()


def _freeze_most(model: nn.Module) -> None:
    for n, p in model.named_parameters():
        if not (n.startswith("blocks.1.") or n.startswith("extra.")):
            p.requires_grad_(False)


@idiom(
    "most parameters frozen before wrapping (`requires_grad=False`, LoRA-style)",
    freeze_before_wrap=_freeze_most,
)
def frozen(u: User) -> None:
    opt = u.optimizer([p for p in u.model.parameters() if p.requires_grad])
    for x, y in u.batches:
        loss = u.model(x, y)
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


@idiom("a branch (`model.extra`) unused in some steps")
def unused_some_steps(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for i, (x, y) in enumerate(u.batches):
        u.model.use_extra = i % 2 == 0
        loss = u.model(x, y)
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)
    u.model.use_extra = True


@idiom("`requires_grad` of a block switched off after step 1 and on again after step 2")
def toggle_requires_grad(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    block = [p for n, p in u.model.named_parameters() if n.startswith("blocks.0.")]
    for i, (x, y) in enumerate(u.batches):
        for p in block:
            p.requires_grad_(i != 1)
        loss = u.model(x, y)
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


@idiom("two forwards, one backward: `(model(x1) + model(x2)).backward()`")
def two_forwards(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        (x1, x2), (y1, y2) = x.chunk(2), y.chunk(2)
        loss = (u.model(x1, y1) + u.model(x2, y2)) / 2
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


@idiom("`model.eval()` + `torch.no_grad()` forward between steps, then `model.train()`")
def eval_between(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        u.model.eval()
        with torch.no_grad():
            u.check("eval_loss", u.side.mean_over_data(_value(u.model(x, y))))
        u.model.train()
        u.check("loss", loss)


@idiom("param groups with different lr and weight decay", needs_param_groups=True)
def param_groups(u: User) -> None:
    decay = [p for n, p in u.model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in u.model.named_parameters() if p.ndim < 2]
    opt = u.optimizer(
        [{"params": decay, "weight_decay": 0.2}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]
    )
    for x, y in u.batches:
        loss = u.model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


@idiom("an LR scheduler (`torch.optim.lr_scheduler.LambdaLR`) stepped every step")
def lr_scheduler(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for x, y in u.batches:
        loss = u.model(x, y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        u.check("loss", loss)
        u.check("lr", torch.tensor(sched.get_last_lr()[0]))


@idiom("`opt.state_dict()` into a new optimizer (`load_state_dict`) mid-training")
def optimizer_state_roundtrip(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for i, (x, y) in enumerate(u.batches):
        if i == 1:
            state = copy.deepcopy(opt.state_dict())
            opt = u.optimizer(u.model.parameters())
            opt.load_state_dict(state)
        loss = u.model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


@idiom("`model.state_dict()` snapshot restored with `model.load_state_dict()` a step later")
def model_state_roundtrip(u: User) -> None:
    opt = u.optimizer(u.model.parameters(), weight_decay=0.0)
    snapshot = None
    for i, (x, y) in enumerate(u.batches):
        if i == 1:
            snapshot = {k: v.detach().clone() for k, v in u.model.state_dict().items()}
        if i == 2:
            u.model.load_state_dict(snapshot)
        loss = u.model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


@idiom("keyword arguments: `model(idx=x, targets=y)`")
def keyword_call(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(idx=x, targets=y)
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


@idiom('inputs in a dict: `model({"idx": x, "targets": y})`', model_cls=DictLM)
def dict_input(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model({"idx": x, "targets": y})
        loss.backward()
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


@idiom("inputs in a tuple: `model((x, y))`", model_cls=TupleLM)
def tuple_input(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model((x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


@idiom("inputs in a dataclass: `model(Batch(x, y))`", model_cls=DataclassLM)
def dataclass_input(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(Batch(x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


_R = [Replicate()]


@idiom(
    "an input plan by position (`input: [[R], [R]]`), the model called by keyword",
    plan={"forward": {"input": [_R, _R]}},
    needs_tp=True,
)
def plan_by_position(u: User) -> None:
    keyword_call(u)


@idiom(
    'an input plan by name (`input: {"idx": [R]}`), the model called positionally',
    plan={"forward": {"input": {"idx": _R, "targets": _R}}},
    needs_tp=True,
)
def plan_by_name(u: User) -> None:
    _plain_loop(u)


@idiom(
    r"a submodule input plan as a regex (`blocks\.\d+\.input`)",
    plan={"forward": {r"blocks\.\d+\.input": [_R]}},
    needs_tp=True,
)
def plan_regex(u: User) -> None:
    _plain_loop(u)


def _plain_loop(u: User) -> None:
    opt = u.optimizer(u.model.parameters())
    for x, y in u.batches:
        loss = u.model(x, y)
        loss.backward()
        u.check("grad", u.grads())
        opt.step()
        opt.zero_grad()
        u.check("loss", loss)


# --------------------------------------------------------------------------- running
def not_applicable(engine: Engine, idi: Idiom) -> str | None:
    """Why a cell does not exist (``None``: it runs)."""
    if idi.needs_tp and not engine.tensor_parallel:
        return "input plans place activations for tensor parallelism"
    return None


def run(side: Side, idi: Idiom) -> list[tuple[str, Any]]:
    torch.manual_seed(0)
    model = idi.model_cls()
    if idi.freeze_before_wrap is not None:
        idi.freeze_before_wrap(model)
    model = side.wrap(model, idi)
    u = User(model, side)
    idi.loop(u)
    u.check("params", u.params())
    return u.records


#: Cells where the engine cannot do what one device does and says so: the engine
#: side must raise this exception (class name, message regex); the table shows it.
EXPECTED_ERRORS: dict[tuple[str, str], tuple[str, str]] = {
    ("zero2", "no-zero-grad-once"): (
        "GradientsReleasedError",
        r"released the full gradients in step\(\).*zero_grad\(\).*zero_stage=1",
    ),
}


#: Single-device records per (reference side, idiom), computed once per process.
REFERENCES: dict[tuple[str, str], list[tuple[str, Any]]] = {}


def reference_side(engine: Engine) -> Side:
    return MuonReference() if engine.optim == "muon" else Side()


def compare(
    got: list[tuple[str, Any]], want: list[tuple[str, Any]], tol: dict | None = None
) -> None:
    tol = tol or TOL
    labels_got = [label for label, _ in got]
    labels_want = [label for label, _ in want]
    assert labels_got == labels_want, f"recorded {labels_got}, reference recorded {labels_want}"
    for k, ((label, g), (_, w)) in enumerate(zip(got, want)):
        where = f"record {k} ({label!r})"
        if isinstance(w, dict):
            assert set(g) == set(w), f"{where}: keys {sorted(g)} != {sorted(w)}"
            for name in w:
                _close(g[name], w[name], f"{where}[{name!r}]", tol)
        else:
            _close(g, w, where, tol)


def _close(g: Any, w: Any, where: str, tol: dict) -> None:
    if w is None or g is None:
        assert g is None and w is None, f"{where}: got {_desc(g)}, single device has {_desc(w)}"
        return
    if isinstance(w, torch.Tensor):
        assert isinstance(g, torch.Tensor), f"{where}: got {_desc(g)}"
        torch.testing.assert_close(g.to(w.dtype), w, **tol, msg=lambda m: f"{where}: {m}")
        return
    assert math.isclose(float(g), float(w), rel_tol=tol["rtol"], abs_tol=tol["atol"]), (
        f"{where}: {g} != {w}"
    )


def _desc(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return repr(v)


def cell(engine_name: str, idiom_name: str) -> None:
    """Run one cell on every rank and compare with the single-device run (same rank)."""
    engine = copy.copy(ENGINES[engine_name])
    idi = IDIOMS[idiom_name]
    ref = reference_side(engine)
    key = (type(ref).__name__, idiom_name)
    if key not in REFERENCES:  # the single-device run is the same for every engine
        REFERENCES[key] = run(ref, idi)
    want = REFERENCES[key]
    expected = EXPECTED_ERRORS.get((engine_name, idiom_name))
    if expected is not None:
        import re

        try:
            run(engine, idi)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ != expected[0] or not re.search(expected[1], str(e), re.S):
                raise
            return
        raise AssertionError(f"{engine_name} x {idiom_name}: expected {expected[0]}, got no error")
    got = run(engine, idi)
    compare(got, want, engine.tol)
