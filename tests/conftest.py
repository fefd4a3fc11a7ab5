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


import pytest


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
