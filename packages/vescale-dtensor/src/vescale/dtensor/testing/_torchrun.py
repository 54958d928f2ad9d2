"""Launch a script under ``torchrun`` for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping

__all__ = ["TorchrunError", "run_torchrun"]

_TAIL = 8000


class TorchrunError(AssertionError):
    """A ``torchrun`` launch failed; the message carries its stdout and stderr.

    Attributes:
        result: The completed process (``None`` after a timeout).
    """

    def __init__(self, message: str, result: subprocess.CompletedProcess | None = None) -> None:
        super().__init__(message)
        self.result = result


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from ``/proc`` (``[]`` where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def _tail(text: str) -> str:
    return text if len(text) <= _TAIL else "...\n" + text[-_TAIL:]


def run_torchrun(
    script_or_module_args: list[str],
    nproc: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
    *,
    expect_marker: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node N ...``.

    ``OMP_NUM_THREADS=1`` (and ``PYTHONFAULTHANDLER=1`` unless set) is set for the
    launched ranks. The whole process tree runs in its own session and is killed on
    timeout.

    Args:
        script_or_module_args: What follows the launcher options, e.g.
            ``["path/to/script.py", "--steps", "2"]`` or ``["-m", "pkg.mod"]``.
        nproc: Processes per node.
        timeout: Seconds before the launch is killed and reported.
        env: Extra environment variables (added to the current environment).
        expect_marker: A string the script prints on success. When given, the
            launch succeeds iff the marker is in stdout, whatever the exit
            code (torch occasionally aborts in ``destroy_process_group`` after
            the work succeeded).
        cwd: Working directory.

    Returns:
        The completed process, with text stdout and stderr.

    Raises:
        TorchrunError: On a failed launch or a timeout, with stdout and stderr.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *script_or_module_args,
    ]
    full_env = dict(os.environ)
    full_env["OMP_NUM_THREADS"] = "1"
    full_env.setdefault("PYTHONFAULTHANDLER", "1")  # a native crash prints the Python stack
    if env:
        full_env.update(env)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun's workers may live in sessions of their own: killing torchrun's group
        # alone would leave them running, holding the output pipes (communicate() would
        # then wait for ever). Kill the whole tree, found before torchrun dies.
        for pid in _descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = "", "(output unavailable: a process kept the pipes open)"
        raise TorchrunError(
            f"torchrun {' '.join(script_or_module_args)} timed out after {timeout:g} s\n"
            f"--- stdout ---\n{_tail(stdout)}\n--- stderr ---\n{_tail(stderr)}"
        ) from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if expect_marker is not None:
        ok = expect_marker in stdout
        why = f"success marker {expect_marker!r} not printed (exit code {proc.returncode})"
    else:
        ok = proc.returncode == 0
        why = f"exit code {proc.returncode}"
    if not ok:
        raise TorchrunError(
            f"torchrun {' '.join(script_or_module_args)} failed: {why}\n"
            f"--- stdout ---\n{_tail(stdout)}\n--- stderr ---\n{_tail(stderr)}",
            result,
        )
    return result
