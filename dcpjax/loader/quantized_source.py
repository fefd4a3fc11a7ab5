"""Sources of quantized weights, and which one a model is read through (`quantized_source`).

- `Fp8CheckpointSource`: a checkpoint quantized the DeepSeek way (config.json's
  `quantization_config`): each quantized `X.weight` float8_e4m3fn with `X.weight_scale_inv`, one
  float32 scale per `weight_block_size` block (or `X.weight_scale`, one per tensor). The scale
  tensors are checked against their weights' shapes before anything is read, and are not
  tensors of their own to the rules.
- `OnlineFp8Source`: `quantization="fp8"` on an unquantized checkpoint: the linear weights the
  published fp8 files quantize (`FP8_TENSORS`) quantized at load by `quantization.fp8.quantize_blocks`,
  block by block in the checkpoint layout, as a checkpoint written in that format holds them.
- `FloatSource`: `quantization="none"`: every tensor dequantized at load.
A GGUF file (`gguf_loader.GGUFSource`) describes its own quantized tensors.
"""

from __future__ import annotations

import collections
import logging
import math
import re
from collections.abc import Callable

import numpy as np

from dcpjax.loader.tensor_source import TensorSource, slice_ranges
from dcpjax.quantization import cpu_kernel
from dcpjax.quantization.formats import DEFAULT_FP8_BLOCK, FP8_DTYPE, BlockFormat, CheckpointQuantization, fp8_format
from dcpjax.quantization.fp8 import quantize_blocks, scales_per_element

logger = logging.getLogger(__name__)

# what the published fp8 checkpoints quantize: every linear projection of attention and the MLPs
# (q_proj, kv_a_proj_with_mqa, kv_b_proj, gate_proj, experts.N.down_proj, in_proj_qkvz, out_proj, ...);
# embeddings, the LM head, norms, routers and their biases stay float
FP8_TENSORS = re.compile(r".*proj[^.]*\.weight$")
# vLLM's names: None / "auto" read what the checkpoint holds; "fp8" holds fp8 block-scaled weights
# (quantizing an unquantized checkpoint at load); "gguf" a GGUF file's own types; "none" dequantizes all
QUANTIZATIONS = ("auto", "fp8", "gguf", "none")


def fp8_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """A tensor the published fp8 checkpoints hold in fp8 (a 2-D linear projection weight)."""
    return len(shape) == 2 and FP8_TENSORS.match(name) is not None


class _Wrapped(TensorSource):
    def __init__(self, inner: TensorSource):
        self.inner = inner

    def names(self):
        return self.inner.names()

    def shape(self, name):
        return self.inner.shape(name)


class FloatSource(_Wrapped):
    """Every tensor float (dequantized on read): `quantization="none"`."""

    def read(self, name, index):
        return self.inner.read(name, index)


class Fp8CheckpointSource(_Wrapped):
    """An fp8 checkpoint's tensors: quantized weights described by `format`, their scales hidden."""

    def __init__(self, inner: TensorSource, quant: CheckpointQuantization):
        super().__init__(inner)
        suffix = "_scale_inv" if quant.weight_block_size else "_scale"
        names = inner.names()
        self.scale_names = {n.removesuffix(suffix): n for n in names if n.endswith(".weight" + suffix)}
        self.block = quant.weight_block_size
        for weight, scale in self.scale_names.items():
            self._check(weight, scale, names)
        unscaled = sorted(n for n in names - set(self.scale_names) - set(self.scale_names.values())
                          if str(inner.dtype(n)) == FP8_DTYPE)
        if unscaled:
            raise ValueError(f"float8_e4m3fn tensors without their X.weight{suffix}: {', '.join(unscaled[:5])}; "
                             f"each quantized X.weight needs one (quantization_config {quant.to_hf()})")
        self._scales: dict[str, np.ndarray] = {}

    def _check(self, weight: str, scale: str, names: set[str]) -> None:
        if weight not in names:
            raise ValueError(f"checkpoint tensor {scale} has no weight {weight}")
        shape, got = self.inner.shape(weight), tuple(self.inner.shape(scale))
        if len(shape) != 2:
            raise ValueError(f"checkpoint tensor {weight} of shape {shape} is fp8-scaled; only 2-D weights can be")
        block = self.block or shape
        want = tuple(math.ceil(n / b) for n, b in zip(shape, block))
        if got != want and not (self.block is None and math.prod(got) == 1):
            raise ValueError(f"checkpoint tensor {scale} has shape {got}, but {weight} of shape {shape} in blocks "
                             f"of {list(block)} (weight_block_size) needs {want}")

    def names(self):
        return self.inner.names() - set(self.scale_names.values())

    def format(self, name):
        if name not in self.scale_names:
            return None
        return fp8_format(self.block or self.inner.shape(name), per_tensor=self.block is None)

    def _scale(self, name: str) -> np.ndarray:
        if name not in self._scales:
            scale = self.scale_names[name]
            whole = (slice(None),) * len(self.inner.shape(scale))
            self._scales[name] = np.asarray(self.inner.read(scale, whole), np.float32).reshape(
                [math.ceil(n / b) for n, b in zip(self.inner.shape(name), self.format(name).block)])
        return self._scales[name]

    def read_part(self, name, index, part):
        if name not in self.scale_names or part == "offset":
            return super().read_part(name, index, part)
        if part == "values":
            return self.inner.read(name, index)
        rows, cols = slice_ranges(index, self.inner.shape(name))
        return scales_per_element(self._scale(name), self.format(name).block, rows, cols)

    def read(self, name, index):
        values = self.inner.read(name, index)
        if name not in self.scale_names:
            return values
        return values.astype(np.float32) * self.read_part(name, index, "scale")


def fp8_formats(block: tuple[int, int] | None) -> Callable[[str, tuple[int, ...]], BlockFormat | None]:
    """(tensor name, shape) -> its format when a checkpoint is quantized to fp8 as the published files
    are (`FP8_TENSORS`), in `block`s, or one scale per tensor (`block` None)."""
    def format_of(name: str, shape: tuple[int, ...]) -> BlockFormat | None:
        if not fp8_quantizable(name, shape):
            return None
        return fp8_format(shape, per_tensor=True) if block is None else fp8_format(block)

    return format_of


class OnlineFp8Source(_Wrapped):
    """An unquantized checkpoint read as fp8 (`quantization="fp8"`): each tensor of `FP8_TENSORS`
    quantized whole when first read, in `block`s (None: one scale per tensor). Quantized tensors are
    kept while they fit `cache_bytes` (least recently used dropped first): the devices read their
    slices in turn, and one expert rule reads every expert of a layer per device."""

    def __init__(self, inner: TensorSource, block: tuple[int, int] | None = DEFAULT_FP8_BLOCK,
                 cache_bytes: int = 1 << 30):
        super().__init__(inner)
        self.formats = fp8_formats(block)
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict[str, tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
        self._cached_bytes = 0

    def format(self, name):
        return self.formats(name, self.inner.shape(name))

    def _quantized(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        whole = np.asarray(self.inner.read(name, (slice(None),) * 2), np.float32)
        values, scale = self._cache[name] = quantize_blocks(whole, self.format(name).block)
        self._cached_bytes += values.nbytes + scale.nbytes
        while len(self._cache) > 1 and self._cached_bytes > self.cache_bytes:
            _, (old_values, old_scale) = self._cache.popitem(last=False)
            self._cached_bytes -= old_values.nbytes + old_scale.nbytes
        return values, scale

    def read_part(self, name, index, part):
        fmt = self.format(name)
        if fmt is None or part == "offset":
            return super().read_part(name, index, part)
        values, scale = self._quantized(name)
        rows, cols = slice_ranges(index, values.shape)
        if part == "values":
            return values[rows.start:rows.stop, cols.start:cols.stop]
        return scales_per_element(scale, fmt.block, rows, cols)

    def read(self, name, index):
        if self.format(name) is None:
            return self.inner.read(name, index)
        return self.read_part(name, index, "values").astype(np.float32) * self.read_part(name, index, "scale")


def _say_held_is_slower_on_cpu(quantization: str) -> None:
    """A holding slower than float was chosen (asked for, or an fp8 checkpoint's own) on a CPU without the
    compiled kernel: say why, once per load, where a user sees it (the time is otherwise unexplained)."""
    log = logger.warning if quantization != "auto" else logger.info
    log("weights held quantized on CPU (quantization=%r) without the compiled kernel (no C++ compiler, or "
        "DCPJAX_CPU_KERNEL=0): the XLA path dequantizes a tile at a time, slower than quantization='none'; the "
        "weights take less memory (docs/quantization.md)", quantization)


def quantized_source(source: TensorSource, quantization: str | None, is_gguf: bool,
                     checkpoint: CheckpointQuantization | None, shipped: CheckpointQuantization | None = None,
                     platform: str = "gpu") -> TensorSource:
    """The source a model is loaded through for `quantization` (see `QUANTIZATIONS`).

    `checkpoint`: what the weights hold (an fp8 checkpoint's quantization_config: read as fp8
    whatever is asked); `shipped`: what the model's config says it ships as, which random weights
    (`load_format="dummy"`) follow under "auto", so they hold what the checkpoint would. "auto"
    holds what the checkpoint holds; on a CPU without the compiled quantized-matmul kernel
    (`quantization.cpu_kernel`) it dequantizes a GGUF file at load instead, since XLA's own path is
    slower than float there (with the kernel, held SmolLM2 decodes 1.3-1.6x faster than float at
    batch 1, 0.8-1.1x at batch 16, in 0.28x the memory: benchmarks/RESULTS.md); "gguf" holds it either
    way. The kernel is built (`cpu_kernel.available()`) only where something could be held."""
    quantization = quantization or "auto"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if checkpoint is not None:
        source = Fp8CheckpointSource(source, checkpoint)
    if quantization == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' holds a GGUF file's own quantized types; these weights are not read "
                         "from a GGUF file (use 'fp8' to quantize them at load, or 'auto')")
    could_hold = is_gguf or checkpoint is not None or quantization == "fp8" or (
        quantization == "auto" and shipped is not None)
    kernel = platform != "cpu" or quantization == "none" or not could_hold or cpu_kernel.available()
    if quantization == "auto" and is_gguf and not kernel:
        quantization = "none"
    if quantization == "none":
        return FloatSource(source)
    wants_fp8 = quantization == "fp8" or (quantization == "auto" and shipped is not None)
    if not kernel and (quantization != "auto" or wants_fp8 or checkpoint is not None):
        _say_held_is_slower_on_cpu(quantization)
    if wants_fp8 and checkpoint is None:
        return OnlineFp8Source(source, shipped.weight_block_size if shipped else DEFAULT_FP8_BLOCK)
    return source
