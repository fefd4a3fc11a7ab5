"""8 fake CPU devices for every test: every mesh shape up to 8 runs on one host.

The suite's models are tiny, so its time is XLA compiling them, not running them: the tests ask
the CPU compiler for its cheapest code (LLVM -O0, no expensive passes). That cuts compile time by
about a third (tests/test_engine.py + test_async_scheduling.py: 114 s -> 71 s CPU) and leaves the
numerics alone: these flags pick fewer optimisations, not a different float semantics. Only the
tests set them; the library and its CLIs compile with XLA's defaults.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# no persistent compilation cache (LLM's default is one in ~/.cache): a cold CI run gains few hits
# and pays for writing every entry; tests of the cache give their own folder
os.environ["DCPJAX_COMPILATION_CACHE_DIR"] = ""

import jax

jax.config.update("jax_num_cpu_devices", 8)


import collections

import pytest

# The files that take minutes on CI's 2 cores (each goes whole to one worker under --dist loadfile), slowest
# first: scheduled before the rest, so that no such file is left running alone at the end. `make test` turns
# off xdist's own order (--no-loadscope-reorder: most tests first), which put one-test files of several
# minutes (the 16k prompt, the notebook) last.
SLOWEST_FILES = ("test_hf_parity.py", "test_kv_transfer.py", "test_disaggregated_serving.py", "test_smollm2.py",
                 "test_gemma3_parity.py", "test_gemma3_long.py", "test_notebook.py", "test_llm.py",
                 "test_readme_and_demo.py", "test_dsa_models.py", "test_gemma3_commands.py")


def pytest_collection_modifyitems(config, items):
    """The slowest files first, the others by number of tests (xdist's default); each file's tests stay
    together and in order (a stable sort)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    count = collections.Counter(str(item.path) for item in items)
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[str(item.path)], str(item.path)))


@pytest.fixture(scope="module")
def gguf_path(request):
    """The file of the built-in pretrained model the test module names in `NAME`; skips where its wheels are
    missing, except under CI (`make test` installs them, so a missing one there is a failure)."""
    from dcpjax.loader.model_source import builtin_gguf_path

    try:
        return builtin_gguf_path(request.module.NAME)
    except ValueError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))
