"""vescale-checkpoint installs into the shared ``vescale`` namespace and reports its version."""

import importlib.metadata

import vescale
import vescale.checkpoint
from vescale.checkpoint.__about__ import __version__


def test_import_and_version():
    assert vescale.checkpoint.__version__ == __version__
    assert importlib.metadata.version("vescale-checkpoint") == __version__


def test_public_names():
    assert "__version__" in vescale.checkpoint.__all__
    for name in vescale.checkpoint.__all__:
        assert hasattr(vescale.checkpoint, name)


def test_vescale_is_a_namespace_package():
    # PEP 420: no package ships vescale/__init__.py.
    assert getattr(vescale, "__file__", None) is None
    assert len(list(vescale.__path__)) >= 1
