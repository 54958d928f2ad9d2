"""Refer to a module-level function so that another process can import and call it.

Test modules usually live in ``tests/`` folders without ``__init__.py`` and are
imported by pytest under names that a fresh interpreter cannot import. A
`FuncRef` therefore records the defining file as well as the module name,
and `resolve` imports the module by name only when that name resolves to
the same file; otherwise it loads the file under a private module name.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["ORIGINAL_ATTR", "FuncRef", "make_ref", "resolve", "unwrap"]

#: Attribute under which `vescale.dtensor.testing.distributed` stores the
#: undecorated test function on its wrapper.
ORIGINAL_ATTR = "__vescale_distributed_original__"

_LOADED_BY_PATH: dict[str, ModuleType] = {}


@dataclass(frozen=True)
class FuncRef:
    """A picklable pointer to a module-level function.

    Attributes:
        module: ``__module__`` of the function in the process that created the ref.
        qualname: ``__qualname__`` of the function (no ``<locals>`` allowed).
        file: Absolute path of the defining source file, or ``None``.
    """

    module: str
    qualname: str
    file: str | None


def unwrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Return the undecorated function behind a ``distributed`` wrapper (or ``fn``)."""
    return getattr(fn, ORIGINAL_ATTR, fn)


def make_ref(fn: Callable[..., Any]) -> FuncRef:
    """Build a `FuncRef` for ``fn``.

    Args:
        fn: A module-level function (or a ``distributed`` wrapper of one).

    Returns:
        The reference.

    Raises:
        ValueError: If ``fn`` is a lambda, a nested function or has no module.
    """
    fn = unwrap(fn)
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not qualname or not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"expected an importable module-level function, got {fn!r} "
            "(lambdas, nested functions and builtins cannot run on other ranks)"
        )
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None) if mod is not None else None
    return FuncRef(module=module, qualname=qualname, file=os.path.abspath(file) if file else None)


def _rewritten_test_code(path: str) -> Any:
    """Compile a test file with pytest's assertion rewriting, as pytest would.

    Returns ``None`` (plain import) for non-test files or when pytest's
    internals are unavailable.
    """
    if not _is_test_file(path):
        return None
    try:
        import ast

        from _pytest.assertion.rewrite import rewrite_asserts

        with open(path, "rb") as f:
            source = f.read()
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path, None)
        return compile(tree, path, "exec", dont_inherit=True)
    except Exception:  # noqa: BLE001 (fall back to a plain import)
        return None


def _load_by_path(path: str) -> ModuleType:
    cached = _LOADED_BY_PATH.get(path)
    if cached is not None:
        return cached
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"_vescale_rankmod_{stem}_{digest}"
    folder = os.path.dirname(path)
    if folder not in sys.path:
        # Mirror pytest's default "prepend" import mode so that sibling helper
        # modules of a test file stay importable.
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a module from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        code = _rewritten_test_code(path)
        if code is not None:
            exec(code, module.__dict__)  # noqa: S102
        else:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _LOADED_BY_PATH[path] = module
    return module


def _is_test_file(path: str) -> bool:
    base = os.path.basename(path)
    return base.startswith("test_") or base.endswith("_test.py") or base == "conftest.py"


def _import_module(ref: FuncRef) -> ModuleType:
    if ref.file is not None and _is_test_file(ref.file):
        # Test files load by path, with pytest's assertion rewriting.
        return _load_by_path(ref.file)
    if ref.module != "__main__":
        existing = sys.modules.get(ref.module)
        if existing is not None and (
            ref.file is None or os.path.abspath(getattr(existing, "__file__", "") or "") == ref.file
        ):
            return existing
        try:
            spec = importlib.util.find_spec(ref.module)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and (
            ref.file is None or (spec.origin and os.path.abspath(spec.origin) == ref.file)
        ):
            return importlib.import_module(ref.module)
    if ref.file is None:
        raise ImportError(f"cannot import module {ref.module!r} and its file is unknown")
    return _load_by_path(ref.file)


def resolve(ref: FuncRef) -> Callable[..., Any]:
    """Import the function a `FuncRef` points to and return it undecorated."""
    obj: Any = _import_module(ref)
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    return unwrap(obj)
