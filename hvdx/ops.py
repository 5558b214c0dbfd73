"""hvdx's TensorFlow custom ops: loading the library built from csrc/, and Python wrappers.

The library is loaded once, at import. Before loading it, the build facts embedded in
the file (csrc/build_info.cc.in) are checked against the running TensorFlow, so that a
missing or stale build fails with an ImportError that says how to rebuild, instead of an
undefined-symbol error or a crash.
"""
from __future__ import annotations

import importlib.machinery
import json
import os
from pathlib import Path
import warnings
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from hvdx.arguments import integer, is_integer

__all__ = ["build_info", "dequantize", "error_feedback", "gpu_problems", "library_path", "load_library", "mstopk",
           "quantize", "shared_read", "shared_update", "sparse_accumulate", "stateless_mstopk"]

_MARKER = b"hvdx-build-info:"
_LIBRARY_ENV = "HVDX_OPS_LIBRARY"  # overrides where the library is looked for
_REBUILD = (
    "Rebuild it in this environment with `make build` from the hvdx checkout, or with "
    "`pip install --no-build-isolation --no-deps -e .` (TensorFlow {tf} must be importable "
    "while it builds)."
)

TensorLike = Union[tf.Tensor, Any]


def library_path() -> Path:
    """Where the op library is expected: $HVDX_OPS_LIBRARY, else next to this module."""
    override = os.environ.get(_LIBRARY_ENV)
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_hvdx_ops{suffix}"
        if candidate.exists():
            return candidate
    return here / f"_hvdx_ops{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def read_build_info(path: Union[str, Path]) -> dict:
    """The build facts embedded in a built op library (without loading it)."""
    data = Path(path).read_bytes()
    start = data.find(_MARKER)
    if start < 0:
        raise ValueError(f"{path} has no hvdx build information: it is not an hvdx op library")
    start += len(_MARKER)
    end = data.find(b"\0", start)
    return json.loads(data[start:end].decode("utf-8"))


def load_library(path: Union[str, Path]):
    """Loads the op library at `path`, or raises ImportError with a rebuild hint."""
    path = Path(path)
    hint = _REBUILD.format(tf=tf.__version__)
    if not path.exists():
        raise ImportError(f"hvdx's op library is missing: {path} does not exist. {hint}")
    try:
        info = read_build_info(path)
    except (OSError, ValueError) as exc:
        raise ImportError(f"hvdx's op library {path} is unreadable ({exc}). {hint}") from exc
    if info.get("tf_version") != tf.__version__:
        raise ImportError(
            f"hvdx's op library {path} was built against TensorFlow {info.get('tf_version')}, "
            f"but TensorFlow {tf.__version__} is running. {hint}")
    try:
        return tf.load_op_library(str(path))
    except (tf.errors.NotFoundError, OSError) as exc:
        raise ImportError(f"hvdx's op library {path} failed to load: {exc}. {hint}") from exc


def _cuda_major(version: str) -> Optional[int]:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def gpu_problems(info: dict, devices: Sequence[Tuple[str, Tuple[int, int]]],
                 driver_version: Optional[int]) -> List[str]:
    """Why the CUDA kernels of a library built as `info` could not run here, one line each.

    devices: (name, compute capability) of the GPUs TensorFlow sees; driver_version: the
    CUDA driver's version (cuDriverGetVersion, e.g. 12040), None when unknown. A device
    runs the kernels if some built SASS architecture has its major version and a minor
    version at most its own, or the PTX architecture (the one without "-real") is at most
    its compute capability.
    """
    if not devices:
        return []
    if not info.get("cuda"):
        return [f"hvdx's op library was built without CUDA: its ops run on the CPU although TensorFlow "
                f"sees {len(devices)} GPU(s). Rebuild where nvcc is installed (HVDX_WITH_CUDA=ON)."]
    problems = []
    built = _cuda_major(info.get("cuda_version", ""))
    if driver_version is not None and built is not None and driver_version // 1000 < built:
        problems.append(f"the NVIDIA driver supports CUDA {driver_version // 1000}.{driver_version % 1000 // 10}, "
                        f"but hvdx's kernels were built with CUDA {info.get('cuda_version')}: update the "
                        f"driver or rebuild hvdx with an older nvcc.")
    sass, ptx = [], []
    for arch in str(info.get("cuda_architectures", "")).split(";"):
        arch = arch.strip()
        if not arch:
            continue
        number = int(arch.split("-")[0])
        (sass if not arch.endswith("-virtual") else ptx).append(number)
        if not arch.endswith("-real") and not arch.endswith("-virtual"):
            ptx.append(number)
    for name, (major, minor) in devices:
        cc = 10 * major + minor
        if not any(a // 10 == major and a % 10 <= minor for a in sass) and not any(p <= cc for p in ptx):
            problems.append(f"{name} (compute capability {major}.{minor}) cannot run hvdx's kernels, built for "
                            f"{info.get('cuda_architectures')}: rebuild with HVDX_CUDA_ARCHITECTURES={cc}.")
    return problems


def _driver_version() -> Optional[int]:
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        return version.value if cuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None
    except OSError:
        return None


def _check_gpus(info: dict) -> None:
    """Warns, at import, when TensorFlow's GPUs cannot run the loaded library's kernels."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    devices = []
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        devices.append((details.get("device_name", gpu.name), tuple(details.get("compute_capability", (0, 0)))))
    for problem in gpu_problems(info, devices, _driver_version()):
        warnings.warn(f"hvdx: {problem}", RuntimeWarning, stacklevel=3)


_LIBRARY_PATH = library_path()
_ops = load_library(_LIBRARY_PATH)
_BUILD_INFO = read_build_info(_LIBRARY_PATH)
_check_gpus(_BUILD_INFO)


def build_info() -> dict:
    """How the loaded op library was built: TensorFlow version, CUDA, compiler, time."""
    return dict(_BUILD_INFO, path=str(_LIBRARY_PATH))


_FLOAT_DTYPES = (tf.float32, tf.float16, tf.bfloat16)


def _mstopk(x: tf.Tensor, k: tf.Tensor, num_samplings: int, seed: Optional[int],
            index_dtype: tf.DType, name: Optional[str] = None):
    """The raw op: (values, indices, thresholds[2] = (thres1, thres2)) in float64."""
    seed1, seed2 = tf.compat.v1.random.get_seed(seed)
    return _ops.hvdx_mstopk(x=x, k=k, num_samplings=num_samplings, seed=seed1 or 0,
                            seed2=seed2 or 0, Tidx=index_dtype, name=name)


def _mstopk_inputs(x: TensorLike, k: Union[int, TensorLike], num_samplings: int,
                   index_dtype: Optional[tf.DType]) -> Tuple[tf.Tensor, tf.Tensor, int, tf.DType]:
    """Checked (x, k as int64, num_samplings as a Python int, index dtype) of mstopk /
    stateless_mstopk (their Raises)."""
    x = tf.convert_to_tensor(x)
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"mstopk: x must be float32, float16 or bfloat16, got {x.dtype.name}")
    if x.shape.rank is not None and x.shape.rank != 1:
        raise ValueError(f"mstopk: x must be 1-D, got shape {x.shape}")
    num_samplings = integer(num_samplings, "mstopk: num_samplings", 1)
    static_k = tf.get_static_value(k)
    if static_k is not None and (isinstance(static_k, (bool, np.bool_)) or np.asarray(static_k).dtype.kind not in "iu"):
        raise ValueError(f"mstopk: k must be an integer, got {static_k!r}")
    if static_k is not None and int(static_k) < 0:
        raise ValueError(f"mstopk: k must be >= 0, got {int(static_k)}")
    k = tf.cast(k, tf.int64)
    d = x.shape[0] if x.shape.rank == 1 else None
    if index_dtype is None:
        index_dtype = tf.int64 if d is not None and d >= 2 ** 31 else tf.int32
    index_dtype = tf.as_dtype(index_dtype)
    if index_dtype not in (tf.int32, tf.int64):
        raise ValueError(f"mstopk: index_dtype must be tf.int32 or tf.int64, got {index_dtype.name}")
    if index_dtype == tf.int32 and d is not None and d >= 2 ** 31:
        raise ValueError(f"mstopk: int32 indices cannot address {d} elements; use index_dtype=tf.int64")
    return x, k, num_samplings, index_dtype


def mstopk(x: TensorLike, k: Union[int, TensorLike], num_samplings: int = 30,
           seed: Optional[int] = None, name: Optional[str] = None,
           index_dtype: Optional[tf.DType] = None):
    """MSTopK (shi2021, Algorithm 1): exactly min(k, d) elements of large magnitude.

    N = `num_samplings` rounds of bisection on a ratio in [0, 1] place the threshold
    mean(|x|) + ratio * (max(|x|) - mean(|x|)); every element at or above the best round
    with at most k elements (thres1) is selected, and the rest come from one contiguous
    window, at a random offset, of the elements between thres2 (the best round with more
    than k) and thres1, in index order. NaN and Inf rank above every finite value.

    Args:
      x: 1-D float32, float16 or bfloat16 tensor of length d.
      k: how many to select (int or int scalar tensor, >= 0); k >= d selects everything.
      num_samplings: N >= 1, the number of bisection rounds.
      seed: makes the window offsets reproducible (with tf.random.set_seed), as in tf.random:
        the op's generator then draws the same sequence of offsets, one per run of the op.
        For offsets that depend on the inputs alone (a resumed run), `stateless_mstopk`.
      index_dtype: tf.int32 or tf.int64; None: int32 when d < 2**31 (or unknown), else int64.
        tf.int64 selects exactly what int32 would (the same kernel, wider indices).

    Returns:
      (values, indices): values in x's dtype; indices of `index_dtype`.
    """
    x, k, num_samplings, index_dtype = _mstopk_inputs(x, k, num_samplings, index_dtype)
    values, indices, _ = _mstopk(x, k, num_samplings, seed, index_dtype, name=name)
    return values, indices


def stateless_mstopk(x: TensorLike, k: Union[int, TensorLike], seed: TensorLike, num_samplings: int = 30,
                     name: Optional[str] = None, index_dtype: Optional[tf.DType] = None):
    """`mstopk` whose window offset is a pure function of `seed` (as tf.random.stateless_*):
    the same (x, k, seed) select the same elements whatever ran before. hvdx's sparse
    strategies pass (a hash of the buffer's name, its checkpointed step counter), so that a
    resumed run selects what the uninterrupted run would have.

    Args:
      x, k, num_samplings, index_dtype: as `mstopk`.
      seed: shape [2] integer tensor.

    Returns:
      (values, indices), as `mstopk`.

    Raises:
      ValueError: as `mstopk`; a seed whose shape is known and not [2].
    """
    x, k, num_samplings, index_dtype = _mstopk_inputs(x, k, num_samplings, index_dtype)
    seed = tf.cast(seed, tf.int64)
    if seed.shape.rank is not None and seed.shape.as_list() not in ([2], [None]):
        raise ValueError(f"stateless_mstopk: seed must have shape [2], got {seed.shape}")
    values, indices, _ = _ops.hvdx_stateless_mstopk(x=x, k=k, seed=seed, num_samplings=num_samplings,
                                                    Tidx=index_dtype, name=name)
    return values, indices


# Gradients. MSTopK's selection is piecewise constant (and HiTopK runs it outside the tape):
# not differentiable. sparse_accumulate is linear: d output / d dense = 1, d output /
# d values[j] = 1 at indices[j] (out-of-range entries, skipped on the GPU, get zeros).
tf.no_gradient("HvdxMstopk")
tf.no_gradient("HvdxStatelessMstopk")


def _gather_grad(op: tf.Operation, grad: tf.Tensor) -> tf.Tensor:
    values, indices = op.inputs[0], op.inputs[1]
    size = tf.cast(tf.shape(grad)[0], indices.dtype)
    valid = (indices >= 0) & (indices < size)
    picked = tf.gather(grad, tf.where(valid, indices, tf.zeros_like(indices)))
    return tf.cast(tf.where(valid, picked, tf.zeros_like(picked)), values.dtype)


@tf.RegisterGradient("HvdxSparseAccumulate")
def _sparse_accumulate_grad(op: tf.Operation, grad: tf.Tensor):
    return _gather_grad(op, grad), None, grad


@tf.RegisterGradient("HvdxSparseScatter")
def _sparse_scatter_grad(op: tf.Operation, grad: tf.Tensor):
    return _gather_grad(op, grad), None, None


def _sparse_accumulate(values: tf.Tensor, indices: tf.Tensor, dense: tf.Tensor,
                       name: Optional[str] = None) -> tf.Tensor:
    return _ops.hvdx_sparse_accumulate(values=values, indices=indices, dense=dense, name=name)


def sparse_accumulate(values: TensorLike, indices: TensorLike, size: Union[int, TensorLike],
                      out: Optional[TensorLike] = None, name: Optional[str] = None,
                      dtype: Optional[tf.DType] = None) -> tf.Tensor:
    """Dense vector of length `size`: `out` (or zeros) plus `values` added at `indices`.

    Duplicate indices add up. Sums are formed in float32 for 16-bit inputs and rounded once
    to the result's dtype: `out`'s dtype when given, else `dtype` (default: `values`'). This
    is the receiving side of the sparse all-gather (shi2021, Algorithm 2, line 9).

    Raises ValueError for non-float values, non-integer indices or a `size` that disagrees
    with `out`; the op raises InvalidArgumentError for out-of-range indices (CPU) and
    mismatched lengths.
    """
    values = tf.convert_to_tensor(values)
    indices = tf.convert_to_tensor(indices)
    if values.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"sparse_accumulate: values must be float32, float16 or bfloat16, got {values.dtype.name}")
    if indices.dtype not in (tf.int32, tf.int64):
        raise ValueError(f"sparse_accumulate: indices must be int32 or int64, got {indices.dtype.name}")
    if out is None:
        dtype = tf.as_dtype(dtype or values.dtype)
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"sparse_accumulate: dtype must be float32, float16 or bfloat16, got {dtype.name}")
        size = tf.constant(int(size), tf.int64) if is_integer(size) else tf.cast(size, tf.int64)
        return _ops.hvdx_sparse_scatter(values=values, indices=indices, size=size, Tout=dtype, name=name)
    else:
        out = tf.convert_to_tensor(out)
        if out.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"sparse_accumulate: out must be float32, float16 or bfloat16, got {out.dtype.name}")
        static_size = tf.get_static_value(size)
        if out.shape.rank == 1 and out.shape[0] is not None and static_size is not None \
                and int(static_size) != out.shape[0]:
            raise ValueError(f"sparse_accumulate: size={int(static_size)} but out has {out.shape[0]} elements")
    return _sparse_accumulate(values, indices, out, name=name)


# -- error feedback (hvdx.comm.dgc; csrc/kernels/error_feedback.cc) --------------------------
tf.no_gradient("HvdxErrorFeedback")  # state kept outside the tape


def error_feedback(grads: Union[TensorLike, Sequence[TensorLike]], residual: TensorLike, velocity: Optional[TensorLike] = None,
                   momentum: float = 0.0, decay: float = 1.0,
                   name: Optional[str] = None) -> Tuple[tf.Tensor, Optional[tf.Tensor]]:
    """What top-k selects from, in one pass over the buffer (Lin et al. 2018, DGC sec. 3.2):

        g = grads[0] + grads[1] + ...            (in that order)
        u' = momentum * velocity + g             (with `velocity`: momentum correction)
        acc = decay * residual + u'  (or + g without `velocity`)

    each product and sum rounded to float32 as written (CPU and GPU agree bit for bit).

    Args:
      grads: a 1-D float32 tensor of the residual's length, or a list of them (a node's parts
        after its reduce-scatter; more than 8 are summed in groups first).
      residual: 1-D float32, what earlier steps did not send.
      velocity: 1-D float32 of the same length (DGC's local velocity u), or None.
      momentum: m, used with `velocity`.
      decay: the residual's decay (1: plain error feedback).

    Returns:
      (acc, u'), u' None without `velocity`.

    Raises:
      ValueError: no grads, a dtype other than float32, or lengths known to differ.
    """
    if isinstance(grads, (tf.Tensor, tf.Variable, np.ndarray)):
        grads = [grads]
    grads = [tf.convert_to_tensor(g) for g in grads]
    if not grads:
        raise ValueError("error_feedback: give at least one gradient")
    residual = tf.convert_to_tensor(residual)
    tensors = [*grads, residual] + ([] if velocity is None else [tf.convert_to_tensor(velocity)])
    for t in tensors:
        if t.dtype != tf.float32:
            raise ValueError(f"error_feedback: float32 tensors only, got {t.dtype.name}")
        if t.shape.rank is not None and (t.shape.rank != 1 or not t.shape[:1].is_compatible_with(residual.shape[:1])):
            raise ValueError(f"error_feedback: 1-D tensors of one length, got shapes {[t.shape for t in tensors]}")
    while len(grads) > 8:  # the kernel's GradientList::kMax
        grads = [tf.add_n(grads[:len(grads) - 7]), *grads[len(grads) - 7:]]
    acc, out = _ops.hvdx_error_feedback(grads=grads, residual=residual,  # velocity [0]: none
                                        velocity=tf.zeros([0], tf.float32) if velocity is None else tensors[-1],
                                        momentum=float(momentum), decay=float(decay), name=name)
    return acc, (None if velocity is None else out)


def _check_quantized(bits: int, chunk: int) -> None:
    if bits not in (8, 4) or isinstance(bits, bool):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if not is_integer(chunk) or chunk < 2 or chunk % 2:
        raise ValueError(f"chunk must be an even int >= 2, got {chunk!r}")


def quantize(x: TensorLike, bits: int, chunk: int, name: Optional[str] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """The chunked low-bit codes of `x` in one pass (CPU and CUDA; csrc/kernels/quantize.h): per chunk
    s = max|x| / L, L = 2^(bits-1) - 1, and q = clip(round_half_even(x / s), -L, L) (0 where s
    is 0); hvdx/comm/wire.py's `quantize`, bit for bit for finite x.

    Args:
      x: 1-D float32, a length that is a multiple of `chunk`.
      bits: 8 or 4.
      chunk: values per scale, an even int >= 2.

    Returns:
      (packed, dequantized): the uint8 codes (int8, or two q + 8 nibbles a byte, the first
      high) then the float32 scales' bytes; q * s, what the receiver decodes.

    Raises:
      ValueError: bits, chunk or a length known not to be a multiple of chunk.
    """
    _check_quantized(bits, chunk)
    x = tf.convert_to_tensor(x, tf.float32)
    if x.shape.rank is not None and (x.shape.rank != 1 or (x.shape[0] is not None and x.shape[0] % chunk)):
        raise ValueError(f"quantize: a 1-D tensor whose length is a multiple of chunk = {chunk}, got shape {x.shape}")
    return tuple(_ops.hvdx_quantize(x, bits=int(bits), chunk=int(chunk), name=name))


def dequantize(packed: TensorLike, bits: int, chunk: int, name: Optional[str] = None) -> tf.Tensor:
    """The float32 values of `quantize`'s packed bytes (the same bits and chunk): q * s.

    Raises:
      ValueError: bits or chunk (a packed length that is not whole chunks: InvalidArgumentError
        when it runs).
    """
    _check_quantized(bits, chunk)
    return _ops.hvdx_dequantize(tf.convert_to_tensor(packed, tf.uint8), bits=int(bits), chunk=int(chunk), name=name)


# -- the shared model (hvdx.asynchronous; csrc/kernels/shared_model.cc) ---------------------------
_SHARED_READ_MODES = ("none", "block", "whole")
_SHARED_UPDATE_MODES = ("atomic", "block", "whole")


def shared_read(address: TensorLike, mode: str = "none", name: Optional[str] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """(values, version): a copy of the shared model at `address` (SharedModel.address) and
    the number of updates applied to it before the copy began. `mode`: "none" (no lock: the
    inconsistent read of kungurtsev2021 sec. 2), "block" (each block under its lock) or
    "whole" (under the lock on the whole vector). Runs on the CPU."""
    if mode not in _SHARED_READ_MODES:
        raise ValueError(f"shared_read mode must be one of {_SHARED_READ_MODES}, got {mode!r}")
    with tf.device("/CPU:0"):
        return _ops.hvdx_shared_read(address=tf.cast(address, tf.int64), mode=mode, name=name)


def shared_update(address: TensorLike, delta: TensorLike, offset: TensorLike = 0, mode: str = "atomic",
                  read_back: bool = False, name: Optional[str] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """shared[offset:offset + len(delta)] += delta with word-sized atomic fetch-and-add;
    `mode` "block" also holds each touched block's lock (ASSM), "whole" the lock on the whole
    vector (gimpel2010 Algorithm 1). Returns (version before this update, the whole model
    right after it when `read_back`, else an empty vector). Runs on the CPU (a GPU tensor is
    copied through the host)."""
    if mode not in _SHARED_UPDATE_MODES:
        raise ValueError(f"shared_update mode must be one of {_SHARED_UPDATE_MODES}, got {mode!r}")
    with tf.device("/CPU:0"):
        return _ops.hvdx_shared_update(address=tf.cast(address, tf.int64), delta=tf.cast(delta, tf.float32),
                                       offset=tf.cast(offset, tf.int64), mode=mode, read_back=read_back,
                                       name=name)
