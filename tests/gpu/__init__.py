"""The GPU tier (see tests/conftest.py): a package, so that its conftest does not shadow the suite's."""
