"""Compare a package's ``check_torch_internals()`` report with the recorded ones."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["expected_torch_internals"]


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def expected_torch_internals(
    report: Mapping[str, str],
    native: list[str],
    recorded: Mapping[tuple[int, int], Mapping[str, str]],
) -> dict[str, str]:
    """The report recorded for the torch under test, to compare ``report`` with.

    Tests know torch versions (the compat code never does): each package records,
    per supported torch release, every internal it probes. ``native`` lists the
    internals expected to be plainly ``"native"``; ``recorded[(major, minor)]`` gives
    the other entries (``"native: <how>"``, ``"fallback: ..."``) of that release.

    Args:
        report: The package's ``check_torch_internals()``.
        native: Internals that are ``"native"`` unless a release says otherwise.
        recorded: Per torch release ``(major, minor)``: the entries that differ.

    Returns:
        The expected report.

    Raises:
        AssertionError: If nothing is recorded for the torch under test (the message
            shows ``report``, to be recorded once checked).
    """
    release = _torch_release()
    if release not in recorded:
        shown = "\n".join(f"  {k!r}: {v!r}," for k, v in report.items())
        raise AssertionError(
            f"no check_torch_internals() report recorded for torch {torch.__version__}; "
            f"check and record this one:\n{shown}"
        )
    expected = dict.fromkeys(native, "native")
    expected.update(recorded[release])
    return expected
