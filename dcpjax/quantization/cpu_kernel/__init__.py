"""The compiled CPU kernel behind `quantization.matmul` (an XLA custom call through `jax.ffi`).

XLA:CPU cannot read a held int8 / fp8 weight without writing a float32 copy of it first (it does
not fuse a convert into a dot's operand), so on CPU the quantized matmul is a small C++ kernel
(`quantized_matmul.cc`) that converts each weight byte in registers. It is compiled on first use
with the machine's C++ compiler (`CXX`, else g++ / c++ / clang++) against the XLA FFI headers jax
ships, for this CPU (`-march=native`), into a cache folder keyed by the source, the jax version, the
flags, the compiler and the CPU, so each machine compiles it once (about 5 s). Without a compiler, or
if the build fails, `available()` is False and the op runs its XLA path instead (slower, same numbers
up to float32 rounding), with one warning saying why; `DCPJAX_CPU_KERNEL=0` chooses that path (logged
at INFO).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("quantized_matmul.cc")
TARGET = "dcpjax_quantized_matmul"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
DISABLE_ENV = "DCPJAX_CPU_KERNEL"


def cache_dir() -> Path:
    """Where compiled kernels are kept: $DCPJAX_CACHE_DIR, else $XDG_CACHE_HOME/dcpjax, else ~/.cache/dcpjax."""
    if os.environ.get("DCPJAX_CACHE_DIR"):
        return Path(os.environ["DCPJAX_CACHE_DIR"]) / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dcpjax" / "kernels"


def jaxlib_version() -> str:
    """The FFI headers the kernel compiles against come with jaxlib."""
    import jaxlib

    return jaxlib.__version__


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU's model and flags (a shared home may span machines)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    """The compiled library for this source, jax and CPU: built once into the cache, atomically."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), jax.__version__, jaxlib_version(), compiler, version,
                                    " ".join(FLAGS), _cpu_signature()]).encode()).hexdigest()[:16]
    library = cache_dir() / f"quantized_matmul-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)  # another process may have built the same file meanwhile: same bytes
    return library


@functools.cache
def available() -> bool:
    """Whether the compiled kernel is registered as the XLA:CPU target `TARGET` (built on first call)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("%s=0: held quantized weights use the XLA path on CPU", DISABLE_ENV)
        return False
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler (g++, c++, clang++ or $CXX): held quantized weights use the slower XLA "
                       "path on CPU; install one (e.g. apt install g++) for the compiled kernel")
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.DcpjaxQuantizedMatmul), platform="cpu")
    except (OSError, RuntimeError) as error:
        logger.warning("the CPU quantized-matmul kernel did not build (%s): held quantized weights use the "
                       "slower XLA path on CPU", error)
        return False
    return True
