"""8 fake CPU devices for every test: every mesh shape up to 8 runs on one host.

JAX's persistent compilation cache is on for the suite (and, through the environment, for every
server and worker process a test starts): many tests build their own engine over the same model, and
each would otherwise compile the same step shapes again. Everything is cached (no minimum compile time
or entry size); the folder is `.jax-cache/` at the repository root, keyed by JAX itself on the jax
version, the program and the devices, so a stale entry is never used. Set JAX_COMPILATION_CACHE_DIR
to use another folder.
"""

import os
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax

jax.config.update("jax_num_cpu_devices", 8)
