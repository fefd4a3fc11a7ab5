"""Compilation, watched: how many XLA compiles this process ran, and JAX's persistent cache.

A server that compiles while a user waits is not ready. `CompileWatch` counts the XLA
compiles of the process from JAX's `jax.monitoring` events: each executable JAX builds reports
a backend-compile duration, whether XLA compiled it or it came from the persistent cache (which
also reports a cache hit), so compiled = built - loaded. The runner tells which of them were
steps first seen after the engine said it was ready (`ModelRunner.mark_ready`).

The persistent compilation cache (`--compilation-cache-dir`) keeps compiled executables on
disk, so a second start with the same model and configuration loads them instead of compiling.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import threading

import jax

logger = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_DIR_ENV = "DCPJAX_COMPILATION_CACHE_DIR"  # "" turns the cache off (the test suite does)


@dataclasses.dataclass
class CompileWatch:
    """Executables JAX built in this process (every jit, not only steps): `built` in all,
    `loaded` of them from the persistent cache, `seconds` spent building them (compiling or
    loading)."""

    built: int = 0
    loaded: int = 0
    seconds: float = 0.0

    def __post_init__(self):
        self._lock = threading.Lock()
        self._compiled = 0

    @property
    def compiled(self) -> int:
        """Executables XLA compiled (not loaded from the cache). JAX reports a load's cache hit
        before its build, so in between the difference may dip by one: never below what it was."""
        with self._lock:
            self._compiled = max(self._compiled, self.built - self.loaded)
            return self._compiled

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event == BACKEND_COMPILE_EVENT:
            with self._lock:
                self.built += 1
                self.seconds += duration

    def _on_event(self, event: str, **_) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self.loaded += 1


_WATCH: CompileWatch | None = None
_WATCH_LOCK = threading.Lock()


def compile_watch() -> CompileWatch:
    """The process's one CompileWatch (registered with jax.monitoring on first use)."""
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None:
            _WATCH = CompileWatch()
            jax.monitoring.register_event_duration_secs_listener(_WATCH._on_duration)
            jax.monitoring.register_event_listener(_WATCH._on_event)
    return _WATCH


def default_compilation_cache_dir() -> str | None:
    """$DCPJAX_COMPILATION_CACHE_DIR (empty: no cache), else the user cache folder
    ($XDG_CACHE_HOME or ~/.cache) /dcpjax/jax."""
    if CACHE_DIR_ENV in os.environ:
        return os.environ[CACHE_DIR_ENV] or None
    root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return str(pathlib.Path(root) / "dcpjax" / "jax")


def resolve_compilation_cache_dir(value: str | None) -> str | None:
    """The folder a `compilation_cache_dir` setting names: "auto" -> the default, None / "" /
    "none" -> None (off), a path -> itself (with ~ expanded)."""
    if value == "auto":
        return default_compilation_cache_dir()
    if not value or value.lower() == "none":
        return None
    return str(pathlib.Path(value).expanduser())


def use_compilation_cache(path: str | None) -> str | None:
    """Point JAX's persistent compilation cache at `path` (None: leave JAX's setting alone) and
    cache every compile, however quick (a step of a small model compiles in well under JAX's
    default 1 s threshold, and there are many). Returns the folder in use, or None."""
    if path is None:
        return jax.config.jax_compilation_cache_dir or None
    current = jax.config.jax_compilation_cache_dir
    if current and current != path:
        logger.warning("JAX's compilation cache is already %s; keeping it (asked for %s)", current, path)
        return current
    try:
        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a read-only home, say: start anyway, every start compiles
        logger.warning("no compilation cache (%s): pass compilation_cache_dir= a writable folder, or 'none'", error)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
