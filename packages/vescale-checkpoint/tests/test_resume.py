"""Resume determinism on a tiny model with DTensor params; async save overlapping a step."""

import torch
from torch import nn

import vescale.checkpoint as vckpt
from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.ragged import RaggedShard


class Tiny(nn.Module):
    def __init__(self, mesh, layout):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        init = {
            "w1": torch.randn(8, 6, generator=g),
            "b1": torch.randn(8, generator=g),
            "w2": torch.randn(4, 8, generator=g),
        }
        for k, t in init.items():
            self.register_parameter(k, nn.Parameter(distribute_tensor(t, mesh, layout[k])))

    def forward(self, x):
        h = torch.tanh(x @ self.w1.full_tensor().T + self.b1.full_tensor())
        return h @ self.w2.full_tensor().T


LAYOUT_2 = {"w1": [Shard(0)], "b1": [RaggedShard((0,), (1, 3))], "w2": [Replicate()]}
LAYOUT_4 = {"w1": [Shard(1)], "b1": [RaggedShard((0,), (2, 1, 0, 1))], "w2": [Shard(0)]}


def _train(model, opt, steps, start):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + s)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 4, generator=g)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _new(mesh, layout):
    model = Tiny(mesh, layout)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, foreach=False)


def _full(model):
    return {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}


def train_2_ranks(path):
    mesh = init_device_mesh("cpu", (2,))
    ref, ref_opt = _new(mesh, LAYOUT_2)
    _train(ref, ref_opt, 10, 0)

    model, opt = _new(mesh, LAYOUT_2)
    _train(model, opt, 5, 0)
    at_save = _full(model)
    handle = vckpt.save(path, {"model": model, "optimizer": opt, "step": 5}, async_op=True)
    _train(model, opt, 5, 5)  # overlaps the background write
    handle.result()
    assert handle.blocking_seconds <= handle.total_seconds
    assert all(torch.equal(a, b) for a, b in zip(_full(model).values(), _full(ref).values()))

    fresh, fresh_opt = _new(mesh, LAYOUT_2)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    vckpt.load(path, state)
    assert state["step"] == 5
    for k, v in _full(fresh).items():
        assert torch.equal(v, at_save[k]), f"{k}: async save did not capture the state at save time"
    _train(fresh, fresh_opt, 5, 5)
    for k, v in _full(fresh).items():
        assert torch.equal(v, _full(ref)[k]), f"{k} differs after resume on the same mesh"
    return _full(ref)


def resume_4_ranks(path, ref):
    mesh = init_device_mesh("cpu", (4,))
    model, opt = _new(mesh, LAYOUT_4)
    vckpt.load(path, {"model": model, "optimizer": opt, "step": 0})
    _train(model, opt, 5, 5)
    for k, v in _full(model).items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=1e-6)


def test_resume_same_and_different_mesh(tmp_path):
    path = str(tmp_path / "step5")
    ref = run_on_ranks(train_2_ranks, 2, path)[0]
    run_on_ranks(resume_4_ranks, 4, path, ref)
