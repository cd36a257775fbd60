import os

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter; it must be chosen before any kernel
# module is imported, so it is set here, ahead of every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.support.triton_interp import skip_repatching

    skip_repatching()  # a kernel's helper calls no longer re-patch triton.language (tests/support/triton_interp.py)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Tiny checkpoints written once per test session (make-tiny layouts, never a hub)."""
    return tmp_path_factory.mktemp("tiny")
