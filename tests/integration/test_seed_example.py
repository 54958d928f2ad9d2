"""The guide's program (examples/seed/train.py) under torchrun, verbatim, on 4 CPU ranks."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from torch import nn

from vescale.dtensor.testing import TorchrunError, run_on_ranks, run_torchrun

SCRIPT = pathlib.Path(__file__).parents[2] / "examples" / "seed" / "train.py"


def _single_device(steps: int = 5) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.weight.sum().item()


def _seed_on_pool(flags: list[str]) -> tuple[str, str | None]:
    """The script run as ``__main__`` on a pool rank: (stdout, the error it raised, if any).

    The pool's ranks already form the default process group that torchrun would set up;
    the gradient-sync debugging the script turns on is turned off again afterwards.
    """
    import contextlib
    import io
    import runpy
    import sys

    import vescale.debug as debug

    enable, handles = debug.enable_gradient_sync_debug, []

    def recording_enable(*args, **kwargs):
        handles.append(enable(*args, **kwargs))
        return handles[-1]

    argv, sys.argv = sys.argv, [str(SCRIPT), *flags]
    debug.enable_gradient_sync_debug = recording_enable
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(SCRIPT), run_name="__main__")
        return out.getvalue(), None
    except Exception as e:  # noqa: BLE001 (returned: the test asserts on it)
        return out.getvalue(), f"{type(e).__name__}: {e}"
    finally:
        sys.argv = argv
        debug.enable_gradient_sync_debug = enable
        for h in handles:
            h.remove()


def _check_matches_single_device(stdout: str) -> None:
    losses = [float(v) for v in re.findall(r"step \d+ loss (\S+)", stdout)]
    checksum = float(re.search(r"weight checksum (\S+)", stdout).group(1))
    want, want_sum = _single_device()
    assert losses == pytest.approx(want, abs=1e-6)
    assert checksum == pytest.approx(want_sum, abs=1e-5)


def _check_names_the_desynchronised_parameter(text: str) -> None:
    assert "GradientSyncError" in text
    assert "linear.weight" in text and "linear.bias" in text
    assert "ranks [1]" in text


# Each outcome runs once as users run it, under torchrun (4 interpreters per launch); the
# flag variants run the same file on the 4-rank pool (--no-plan: no plan at all;
# --debug-late: debugging enabled after the model is built, without naming it).
@pytest.mark.torchrun
def test_seed_program_under_torchrun_matches_single_device():
    out = run_torchrun([str(SCRIPT)], 4, timeout=600, expect_marker="weight checksum")
    _check_matches_single_device(out.stdout)


@pytest.mark.torchrun
def test_seed_debug_tool_under_torchrun_names_the_desynchronised_parameter():
    with pytest.raises(TorchrunError) as info:
        run_torchrun([str(SCRIPT), "--desync"], 4, timeout=600, expect_marker="weight checksum")
    _check_names_the_desynchronised_parameter(info.value.args[0] if info.value.args else "")


def test_seed_program_without_a_plan_and_late_debugging_matches_single_device():
    results = run_on_ranks(_seed_on_pool, 4, ["--no-plan", "--debug-late"], timeout=300)
    assert [err for _, err in results] == [None] * 4
    _check_matches_single_device(results[0][0])


def test_seed_debug_tool_enabled_late_names_the_desynchronised_parameter():
    results = run_on_ranks(_seed_on_pool, 4, ["--desync", "--debug-late"], timeout=300)
    for _, err in results:  # every rank raises the same error from backward()
        assert err is not None
        _check_names_the_desynchronised_parameter(err)
