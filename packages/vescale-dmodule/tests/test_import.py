"""vescale-dmodule installs into the shared ``vescale`` namespace and reports its version."""

import importlib.metadata

import vescale
import vescale.dmodule
from vescale.dmodule.__about__ import __version__


def test_import_and_version():
    assert vescale.dmodule.__version__ == __version__
    assert importlib.metadata.version("vescale-dmodule") == __version__


def test_public_names():
    assert "__version__" in vescale.dmodule.__all__
    for name in vescale.dmodule.__all__:
        assert hasattr(vescale.dmodule, name)


def test_vescale_is_a_namespace_package():
    # PEP 420: no package ships vescale/__init__.py.
    assert getattr(vescale, "__file__", None) is None
    assert len(list(vescale.__path__)) >= 1
