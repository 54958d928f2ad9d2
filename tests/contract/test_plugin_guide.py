"""The complete example plugin of docs/plugins.md runs as written, on 4 gloo ranks.

The test reads ``rows_plugin.py`` and ``use_rows.py`` from the page (the fenced blocks with
those titles), imports the first as a module and runs the second, which asserts what the
guide claims: an empty rank's piece and flat ranges, the direct steps chosen by the planner
(``get_plan().describe()``), an all-to-all and a broadcast (with a group rank) inside steps,
the gradient through the reverse step, a local op, and a mesh-size check raised before any
communication. Further checks cover what the guide says other packages rely on: checkpoint
boxes from ``local_flat_ranges`` and ``clip_grad_norm_`` counting every element once.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from pathlib import Path

import torch

from vescale.dtensor.testing import distributed

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _block(title: str) -> str:
    match = re.search(rf'```python title="{re.escape(title)}"\n(.*?)```', PAGE.read_text(), re.S)
    assert match, f"docs/plugins.md has no python block titled {title}"
    return match.group(1)


@distributed(4)
def test_complete_example_from_the_guide():
    from vescale.dtensor import (
        DTensor,
        distribute_tensor,
        init_device_mesh,
        placement_registry,
        unregister_plugin,
    )
    from vescale.dtensor.chunks import local_boxes
    from vescale.optim import clip_grad_norm_

    module = types.ModuleType("rows_plugin")
    sys.modules["rows_plugin"] = module  # dataclasses look the module up while it executes
    try:
        exec(compile(_block("rows_plugin.py"), "rows_plugin.py", "exec"), module.__dict__)
        assert "example.Rows" not in placement_registry()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(_block("use_rows.py"), "use_rows.py", "exec"), {"__name__": "__main__"})
        assert "2 sizes for a mesh dim of 4 ranks" in out.getvalue(), out.getvalue()
        Rows = module.Rows
        assert placement_registry()["example.Rows"] is Rows

        # Checkpoint boxes come from local_flat_ranges; the empty rank has none.
        rank = torch.distributed.get_rank()
        boxes, local = local_boxes((8, 3), (4,), (rank,), [Rows((3, 0, 4, 1))])
        expected = {0: [((0, 0), (3, 3))], 1: [], 2: [((3, 0), (4, 3))], 3: [((7, 0), (1, 3))]}
        assert [(tuple(b.offsets), tuple(b.sizes)) for b in boxes] == expected[rank], boxes
        assert tuple(local) == ((3, 0, 4, 1)[rank], 3)

        # clip_grad_norm_ counts each element once (one rank per element).
        mesh = init_device_mesh("cpu", (4,))
        g = torch.arange(24.0).reshape(8, 3) / 10
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 3), mesh, [Rows((3, 0, 4, 1))]))
        p.grad = distribute_tensor(g, mesh, [Rows((3, 0, 4, 1))])
        assert isinstance(p.grad, DTensor)
        norm = clip_grad_norm_([p], max_norm=1.0)
        torch.testing.assert_close(norm, torch.linalg.vector_norm(g))
        torch.testing.assert_close(
            p.grad.full_tensor(), g / torch.linalg.vector_norm(g), atol=1e-6, rtol=1e-5
        )
    finally:
        if "example.Rows" in placement_registry():
            unregister_plugin(module)
        sys.modules.pop("rows_plugin", None)
