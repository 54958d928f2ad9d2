"""vescale-optim installs into the shared ``vescale`` namespace and reports its version."""

import importlib.metadata

import vescale
import vescale.optim
from vescale.optim.__about__ import __version__


def test_import_and_version():
    assert vescale.optim.__version__ == __version__
    assert importlib.metadata.version("vescale-optim") == __version__


def test_public_names():
    assert "__version__" in vescale.optim.__all__
    for name in vescale.optim.__all__:
        assert hasattr(vescale.optim, name)


def test_vescale_is_a_namespace_package():
    # PEP 420: no package ships vescale/__init__.py.
    assert getattr(vescale, "__file__", None) is None
    assert len(list(vescale.__path__)) >= 1
