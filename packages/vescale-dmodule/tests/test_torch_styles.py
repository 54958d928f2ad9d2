"""torch ``ParallelStyle`` plans through vescale's ``parallelize_module`` / ``DModule``.

The same model and plan through torch's own ``parallelize_module`` and through
vescale's, a few optimizer steps: losses, gradients and parameters equal each other
and the single-device model (fp32, 1e-5).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

from vescale.dmodule import DModule, parallelize_module
from vescale.dmodule.testing import MLP
from vescale.dtensor import Replicate, Shard, init_device_mesh
from vescale.dtensor.testing import distributed

TOL = dict(atol=1e-5, rtol=1e-5)


class Attention(nn.Module):
    """Written for torch TP: local head count from ``view(B, T, -1, head_dim)``."""

    def __init__(self, d=16, n_head=4):
        super().__init__()
        # no key bias: its gradient is zero up to rounding, which AdamW would amplify
        self.q, self.v, self.o = (nn.Linear(d, d) for _ in range(3))
        self.k = nn.Linear(d, d, bias=False)
        self.head_dim = d // n_head

    def forward(self, x, mask=None):
        B, T = x.shape[0], x.shape[1]
        q, k, v = (
            m(x).view(B, T, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        att = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            att = att.masked_fill(~mask, float("-inf"))
        y = att.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class AttnMLP(nn.Module):
    """Attention then an MLP (every key of the plan names a nested module)."""

    def __init__(self, d=16):
        super().__init__()
        self.attn = Attention(d)
        self.mlp = MLP(d, 2 * d)

    def forward(self, x, mask):
        h = x + self.attn(x, mask=mask)
        return h + self.mlp(h)


class SPModel(nn.Module):
    """Embedding, one pre-norm block with LayerNorms, final norm, head (sequence parallel)."""

    def __init__(self, vocab=16, d=16, n_layer=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(d),
                    "attn": Attention(d),
                    "norm2": nn.LayerNorm(d),
                    "mlp": MLP(d, 2 * d),
                }
            )
            for _ in range(n_layer)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        h = self.emb(idx)
        for layer in self.layers:
            h = h + layer["attn"](layer["norm1"](h))
            h = h + layer["mlp"](layer["norm2"](h))
        return self.head(self.norm(h))


def mlp_plan():
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def attn_plan():
    return {
        "attn": PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Replicate(),),
            input_kwarg_layouts={"mask": Replicate()},
            desired_input_kwarg_layouts={"mask": Replicate()},
            use_local_output=True,
        ),
        "attn.[qkv]": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
    }


def sp_plan():
    return {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.norm*": SequenceParallel(),
        "layers.*.attn": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.attn.q": ColwiseParallel(),
        "layers.*.attn.k": ColwiseParallel(),
        "layers.*.attn.v": ColwiseParallel(),
        "layers.*.attn.o": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.mlp.fc1": ColwiseParallel(),
        "layers.*.mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _case(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        model, plan = MLP(8, 16), mlp_plan()
        batches = [((torch.randn(4, 8),), {}) for _ in range(3)]
    elif kind == "attn":
        model, plan = AttnMLP(), attn_plan()
        mask = torch.ones(6, 6, dtype=torch.bool).tril()
        batches = [((torch.randn(2, 6, 16),), {"mask": mask}) for _ in range(3)]
    else:
        model, plan = SPModel(), sp_plan()
        batches = [((torch.randint(0, 16, (2, 8)),), {}) for _ in range(3)]
    with torch.no_grad():
        shape = model(*batches[0][0], **batches[0][1]).shape
    targets = [torch.randn(shape) for _ in batches]
    return model, plan, batches, targets


def _train(model, batches, targets, opt_kind):
    make = torch.optim.AdamW if opt_kind == "adamw" else torch.optim.SGD
    opt = make(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for (args, kwargs), target in zip(batches, targets):
        out = model(*args, **kwargs)
        loss = F.mse_loss(_full(out), target)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return losses, grads, params


def _compare(a, b, what):
    la, ga, pa = a
    lb, gb, pb = b
    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), **TOL, msg=f"{what}: losses")
    for x, y in zip(ga, gb):
        assert x.keys() == y.keys()
        for n in x:
            torch.testing.assert_close(
                x[n], y[n], **TOL, msg=lambda m, n=n: f"{what} grad {n}: {m}"
            )
    for n in pa:
        torch.testing.assert_close(pa[n], pb[n], **TOL, msg=lambda m, n=n: f"{what} param {n}: {m}")


def run_parity(kind, opt_kind, via="parallelize_module"):
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, plan, batches, targets = _case(kind)
    ref = copy.deepcopy(model)
    theirs = torch_parallelize(copy.deepcopy(model), mesh, plan)
    _, plan2, _, _ = _case(kind)  # fresh style objects (torch's mutate some)
    if via == "DModule":
        ours = DModule(model, mesh, plan2)
    else:
        ours = parallelize_module(model, mesh, plan2)
    assert isinstance(ours, DModule)
    # the same placements as torch's
    for (n, p), (n2, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert n == n2 and p.placements == q.placements, (n, p.placements, q.placements)
        assert p.to_local().shape == q.to_local().shape, n
    r_ref = _train(ref, batches, targets, opt_kind)
    r_torch = _train(theirs, batches, targets, opt_kind)
    r_ours = _train(ours, batches, targets, opt_kind)
    _compare(r_ours, r_torch, "vescale vs torch TP")
    _compare(r_ours, r_ref, "vescale vs single device")
    return r_ours[0]


@pytest.mark.parametrize(
    "kind,opt_kind", [("mlp", "sgd"), ("attn", "adamw"), ("sp", "adamw"), ("sp", "sgd")]
)
@distributed(2)
def test_parity_tp2(kind, opt_kind):
    run_parity(kind, opt_kind)


@pytest.mark.slow
@distributed(4)
def test_parity_tp4_dmodule():
    run_parity("attn", "adamw", via="DModule")
    run_parity("sp", "adamw", via="DModule")


@distributed(2)
def test_options_and_dump_plan():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = MLP(8, 16)
    ref = copy.deepcopy(model)
    # use_local_output=False: DTensor outputs; Colwise output_layouts=Replicate gathers
    plan = {
        "fc1": ColwiseParallel(output_layouts=Replicate(), use_local_output=False),
        "fc2": ColwiseParallel(use_local_output=False),
    }
    parallelize_module(model, mesh, plan)
    x = torch.randn(4, 8)
    out = model(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), ref(x), **TOL)
    text = model.dump_plan()
    assert f"fc1.weight: [{Shard(0)}]" in text, text
    assert f"fc1.input: [from_local [{Replicate()}] -> [{Replicate()}]]" in text, text
    assert f"fc2.output: [-> [{Shard(-1)}]]" in text, text
    # PrepareModuleOutput / PrepareModuleInputOutput on the root
    torch.manual_seed(0)
    model = MLP(8, 16)
    plan = {
        "": PrepareModuleInputOutput(
            input_layouts=Shard(0),
            desired_input_layouts=Replicate(),
            output_layouts=Replicate(),
            desired_output_layouts=Shard(0),
        ),
    }
    parallelize_module(model, mesh, plan)
    rank = torch.distributed.get_rank()
    local_x = x.chunk(2)[rank]  # each rank passes its rows; gathered before fc1
    out = model(local_x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, ref(x).chunk(2)[rank], **TOL)
    torch.manual_seed(0)
    model = MLP(8, 16)
    parallelize_module(
        model,
        mesh,
        {
            "fc1": ColwiseParallel(),
            "fc2": RowwiseParallel(use_local_output=False),
            "": PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
            ),
        },
    )
    out = model(x)
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), ref(x), **TOL)


@distributed(4)
def test_2d_mesh_tp_dim_and_mixed_plan():
    # torch's styles on the 'tp' dim of a (dp, tp) mesh, mixed with vescale entries
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = MLP(8, 16)
    ref = copy.deepcopy(model)
    plan = {
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(use_local_output=False),
        "forward": {"output": [[Replicate(), Replicate()]]},
        "parameter": {"fc2.bias": [Replicate(), Replicate()]},
    }
    parallelize_module(model, mesh, plan)
    assert model.fc1.weight.placements == (Replicate(), Shard(0))
    assert model.fc2.weight.placements == (Replicate(), Shard(1))
    x = torch.randn(4, 8)
    out, ref_out = model(x), ref(x)
    torch.testing.assert_close(out.to_local(), ref_out, **TOL)
    out.to_local().sum().backward()
    ref_out.sum().backward()
    for n, p in ref.named_parameters():
        q = dict(model.named_parameters())[n]
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, **TOL)


def _errors():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    class MyColwise(ColwiseParallel):
        pass

    cases = [
        ({"attn.q": ColwiseParallel(), "norm": ColwiseParallel()}, "'norm'", "LayerNorm"),
        ({"fc1": MyColwise()}, "'fc1'", "MyColwise"),
        ({"fc3": ColwiseParallel()}, "'fc3'", "nearest names"),
        ({"fc1": ColwiseParallel(), "fc2": "rowwise"}, "'fc2'", "ParallelStyle"),
        (
            {
                "fc1": ColwiseParallel(),
                "f*1": PrepareModuleInput(
                    input_layouts=Replicate(), desired_input_layouts=Replicate()
                ),
            },
            "'f*1'",
            "both prepare the input",
        ),
        (
            {
                "": PrepareModuleInput(
                    input_layouts=(Replicate(), Replicate()),
                    desired_input_layouts=(Replicate(), Replicate()),
                    input_kwarg_layouts={"y": Replicate()},
                    desired_input_kwarg_layouts={"y": Replicate()},
                )
            },
            "''",
            "positional",
        ),
    ]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
            self.attn = nn.Module()
            self.attn.q = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

        def forward(self, x):
            return self.fc2(self.fc1(x))

    for plan, key, what in cases:
        with pytest.raises(ValueError) as info:
            parallelize_module(Net(), mesh, plan)
        msg = str(info.value)
        assert key in msg and what in msg, msg
    with pytest.warns(UserWarning, match="fc3"):
        parallelize_module(Net(), mesh, {"fc3": ColwiseParallel()}, unmatched_plan_keys="warn")


@distributed(2)
def test_errors():
    _errors()
