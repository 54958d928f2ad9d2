"""Small pieces every package's test suite shares: sibling helper modules, import checks."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType

__all__ = ["check_package", "load_helper"]


def load_helper(test_file: str, name: str) -> ModuleType:
    """The helper module ``<name>.py`` beside ``test_file``, loaded once per process.

    Test folders are not packages, and pytest's ``--import-mode=importlib`` puts nothing
    on ``sys.path``, so a test file cannot ``import`` a helper beside it. This loads it
    by path under a name derived from that path (the same in every process, so objects
    defined in the helper pickle between ranks) and caches it in ``sys.modules``.

    Args:
        test_file: The calling test's ``__file__``.
        name: The helper's module name (file name without ``.py``).

    Returns:
        The loaded module.

    Raises:
        FileNotFoundError: No ``<name>.py`` beside ``test_file``.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(test_file)), f"{name}.py")
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    mod_name = f"_vescale_helper_{name}_{digest}"
    module = sys.modules.get(mod_name)
    if module is not None:
        return module
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_helper: no helper module {path}")
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module


def check_package(module: str, distribution: str) -> None:
    """Assert that ``module`` (e.g. ``"vescale.ragged"``) is installed as a vescale package.

    Checks that its ``__version__`` is the one in its ``__about__`` module and the one
    the installed ``distribution`` (e.g. ``"vescale-ragged"``) reports, that
    ``__version__`` and every name of its ``__all__`` are attributes, and that
    ``vescale`` stays a PEP 420 namespace package (no package ships
    ``vescale/__init__.py``).

    Raises:
        AssertionError: Naming the check that failed.
    """
    mod = importlib.import_module(module)
    about = importlib.import_module(f"{module}.__about__")
    assert mod.__version__ == about.__version__, (module, mod.__version__, about.__version__)
    installed = importlib.metadata.version(distribution)
    assert installed == about.__version__, (distribution, installed, about.__version__)
    assert "__version__" in mod.__all__, f"{module}.__all__ lacks __version__"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names missing attributes: {missing}"
    vescale = importlib.import_module("vescale")
    assert getattr(vescale, "__file__", None) is None, (
        f"vescale is not a namespace package: {vescale.__file__}"
    )
    assert len(list(vescale.__path__)) >= 1
