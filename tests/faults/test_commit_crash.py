"""A crash at any step of the commit leaves a checkpoint that ``load(path)`` finds.

Each case runs a save in a child process that SIGKILLs itself at one step of the
commit (before / after writing the manifest, the ``COMPLETE`` marker, each of the two
renames, the deletion of the previous checkpoint). Afterwards ``is_complete(path)`` is
true and ``load(path)`` returns either the previous or the new checkpoint, bit-exact,
never "no checkpoint".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import vescale.checkpoint as vckpt

# (function patched in vescale.checkpoint._commit's namespace, call number, before/after)
STEPS = {
    "before_manifest": ("write", 1, "before"),
    "after_manifest": ("write", 1, "after"),
    "after_complete": ("write", 2, "after"),
    "after_first_rename": ("rename", 1, "after"),
    "after_second_rename": ("rename", 2, "after"),
    "before_old_deleted": ("rmtree", 1, "before"),
}

_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    import vescale.checkpoint as vckpt
    from vescale.checkpoint import _commit

    path, fn_name, nth, when = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    vckpt.save(path, {"t": torch.ones(32, 32), "step": 1})
    targets = {"write": (_commit, "_write_synced"), "rename": (_commit.os, "rename"),
               "rmtree": (_commit.shutil, "rmtree")}
    owner, attr = targets[fn_name]
    original = getattr(owner, attr)
    calls = [0]

    def crashing(*args, **kwargs):
        # count only the commit's own calls (DCP renames its .metadata.tmp file too)
        if fn_name == "rename" and not os.path.isdir(args[0]):
            return original(*args, **kwargs)
        if fn_name == "rmtree" and ".old-" not in os.fspath(args[0]):
            return original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == nth and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = original(*args, **kwargs)
        if calls[0] == nth and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(owner, attr, crashing)
    vckpt.save(path, {"t": torch.full((32, 32), 2.0), "step": 2})
    print("NOT_CRASHED")
    """
)


@pytest.mark.parametrize("step", list(STEPS))
def test_crash_during_commit_leaves_a_loadable_checkpoint(tmp_path, step):
    path = tmp_path / "ckpt"
    fn_name, nth, when = STEPS[step]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), fn_name, str(nth), when],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert vckpt.is_complete(path), sorted(p.name for p in tmp_path.iterdir())
    state = {"t": torch.zeros(32, 32), "step": 0}
    vckpt.load(path, state)
    assert state["step"] in (1, 2), state["step"]
    assert torch.equal(state["t"], torch.full((32, 32), float(state["step"])))
    # the next save of the same path commits and cleans up what the crash left behind
    vckpt.save(path, {"t": torch.full((32, 32), 3.0), "step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    state = {"t": torch.zeros(32, 32), "step": 0}
    vckpt.load(path, state)
    assert state["step"] == 3 and torch.equal(state["t"], torch.full((32, 32), 3.0))
