"""vescale-dtensor installs into the shared ``vescale`` namespace and reports its version."""

from vescale.dtensor.testing import check_package


def test_import_version_public_names_and_namespace():
    check_package("vescale.dtensor", "vescale-dtensor")
