"""The quick start on the home page (docs/index.md) runs as written, on 2 gloo ranks.

The block titled ``quickstart.py`` is executed on every rank with ``WORLD_SIZE`` set as
``torchrun`` sets it, in a shared directory (the checkpoint path is relative).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

from vescale.dtensor.testing import distributed

PAGE = Path(__file__).resolve().parents[2] / "docs" / "index.md"


@distributed(2)
def test_home_page_quick_start_runs(tmp_path):
    import torch.distributed as dist

    match = re.search(r'```python title="quickstart.py"\n(.*?)```', PAGE.read_text(), re.S)
    assert match, "docs/index.md has no quickstart.py block"
    old_cwd, old_ws = os.getcwd(), os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    os.chdir(tmp_path)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(match.group(1), "quickstart.py", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(old_cwd)
        if old_ws is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = old_ws
    lines = out.getvalue().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["step 0", "step 1", "step 2"], lines
    assert (tmp_path / "ckpt").is_dir()
