import pytest


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Tiny checkpoints written once per test session (make-tiny layouts, never a hub)."""
    return tmp_path_factory.mktemp("tiny")
