"""Builds and loads libhvdx_harness.so (csrc/harness) and calls it through ctypes.

Every call checks the returned status: a non-zero code raises HarnessError with the
kernel's own message (a CUDA launch that failed, an invalid argument), so that no
failure can pass as a result.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "csrc" / "harness"
ABI = 2
MSG = 1024
CODES = {3: "invalid argument", 12: "unimplemented", 13: "internal"}


class HarnessError(RuntimeError):
    """A non-zero status from the harness: .code (3 invalid argument, 13 internal, 12 no CUDA)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"[{CODES.get(code, code)}] {message}")
        self.code = code
        self.message = message


def find_nvcc() -> Optional[str]:
    """nvcc on PATH, else CUDA's default location; None without one."""
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def build(build_dir: Path, cuda: str = "AUTO", architectures: str = "native", jobs: Optional[int] = None,
          log: Optional[Path] = None) -> Path:
    """Configures and builds csrc/harness in build_dir (never in the checkout).

    Args:
        build_dir: CMake's binary directory; created when missing.
        cuda: HVDX_HARNESS_CUDA: "AUTO" (when nvcc is found), "ON" or "OFF".
        architectures: HVDX_HARNESS_CUDA_ARCHITECTURES ("native": this machine's GPU).
        jobs: parallel compile jobs (default: every CPU).
        log: where CMake's output goes (default: build_dir/build.log).
    Returns:
        The path of libhvdx_harness.so.
    Raises:
        RuntimeError: CMake is missing or the build failed (the log's tail is in the message).
    """
    cmake = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if cmake is None:
        raise RuntimeError("cmake is not on PATH: install CMake >= 3.18 (pip install cmake works too)")
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    log = Path(log) if log else build_dir / "build.log"
    env = dict(os.environ)
    nvcc = find_nvcc()
    if nvcc and "CUDACXX" not in env:
        env["CUDACXX"] = nvcc
    steps = [[cmake, "-S", str(SOURCE), "-B", str(build_dir), f"-DHVDX_HARNESS_CUDA={cuda}",
              f"-DHVDX_HARNESS_CUDA_ARCHITECTURES={architectures}"],
             [cmake, "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 2)]]
    with open(log, "w") as out:
        for step in steps:
            out.write("$ " + " ".join(step) + "\n")
            out.flush()
            rc = subprocess.call(step, stdout=out, stderr=subprocess.STDOUT, env=env)
            if rc != 0:
                tail = "\n".join(log.read_text().splitlines()[-40:])
                raise RuntimeError(f"building the harness failed ({' '.join(step[:2])}, exit {rc}); "
                                   f"the log is {log}:\n{tail}")
    return build_dir / "libhvdx_harness.so"


def _index_dtype(index_bits: int) -> np.dtype:
    if index_bits not in (32, 64):
        raise ValueError(f"index_bits must be 32 or 64, got {index_bits}")
    return np.dtype(np.int32 if index_bits == 32 else np.int64)


@dataclass
class TopK:
    """What MSTopK returns: min(k, d) values and indices (index order of the spec), and
    thresholds = (thres1, thres2)."""
    values: np.ndarray
    indices: np.ndarray
    thresholds: Tuple[float, float]


def device_pointer(array: Any) -> int:
    """The device address of a DeviceBuffer, a CuPy array or a PyTorch CUDA tensor."""
    if isinstance(array, DeviceBuffer):
        return array.ptr
    if hasattr(array, "data_ptr"):                      # torch.Tensor
        return int(array.data_ptr())
    if hasattr(array, "data") and hasattr(array.data, "ptr"):  # cupy.ndarray
        return int(array.data.ptr)
    raise TypeError(f"not a device array: {type(array).__name__} (DeviceBuffer, cupy.ndarray or torch.Tensor)")


class Harness:
    """The loaded library. CPU calls take NumPy arrays; GPU calls take device arrays
    (device_pointer) and a stream handle (an int; 0 = the legacy default stream)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path} does not exist: build it with scripts.gpu_harness.lib.build() "
                                    "or scripts/gpu_harness.sh")
        lib = ctypes.CDLL(str(self.path))
        self.lib = lib
        p, i64, u64, i32, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t
        f32 = ctypes.c_float
        sigs = {
            "hvdx_harness_abi": (i32, []),
            "hvdx_harness_has_cuda": (i32, []),
            "hvdx_mstopk_cpu": (i32, [p, i64, i64, i32, u64, p, p, i32, p, i32, p, sz]),
            "hvdx_mstopk_gpu_scratch_bytes": (i64, [i64]),
            "hvdx_mstopk_gpu": (i32, [p, i64, i64, i32, u64, p, p, i32, p, p, p, p, sz]),
            "hvdx_sparse_accumulate_cpu": (i32, [p, p, i32, i64, p, p, i64, i32, p, sz]),
            "hvdx_sparse_accumulate_gpu_workspace_bytes": (i64, [i64, i64, i32]),
            "hvdx_sparse_accumulate_gpu": (i32, [p, p, i32, i64, p, p, i64, p, p, p, sz]),
            "hvdx_error_feedback_cpu": (i32, [p, i32, p, p, f32, f32, p, p, i64, i32, p, sz]),
            "hvdx_error_feedback_gpu": (i32, [p, i32, p, p, f32, f32, p, p, i64, p, p, sz]),
            "hvdx_quantize_cpu": (i32, [p, i64, i32, i32, p, p, i32, p, sz]),
            "hvdx_dequantize_cpu": (i32, [p, i64, i32, i32, p, i32, p, sz]),
            "hvdx_quantize_gpu": (i32, [p, i64, i32, i32, p, p, p, p, sz]),
            "hvdx_dequantize_gpu": (i32, [p, i64, i32, i32, p, p, p, sz]),
            "hvdx_cuda_malloc": (i32, [ctypes.POINTER(ctypes.c_void_p), i64, p, sz]),
            "hvdx_cuda_free": (i32, [p, p, sz]),
            "hvdx_cuda_memcpy": (i32, [p, p, i64, i32, p, sz]),
            "hvdx_cuda_sync": (i32, [p, p, sz]),
            "hvdx_inject_too_large_grid": (i32, [p, p, sz]),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        if lib.hvdx_harness_abi() != ABI:
            raise RuntimeError(f"{self.path} has ABI {lib.hvdx_harness_abi()}, this driver speaks {ABI}: rebuild it")
        self.has_cuda = bool(lib.hvdx_harness_has_cuda())

    # -- status ---------------------------------------------------------------------------
    def call(self, name: str, *args: Any) -> int:
        """Calls `name` with args and the message buffer; returns the status code (0 = ok)."""
        msg = ctypes.create_string_buffer(MSG)
        code = getattr(self.lib, name)(*args, msg, MSG)
        self.last_message = msg.value.decode(errors="replace")
        return code

    def check(self, name: str, *args: Any) -> None:
        """Calls `name`; raises HarnessError on a non-zero status."""
        code = self.call(name, *args)
        if code != 0:
            raise HarnessError(code, self.last_message)

    # -- CPU ------------------------------------------------------------------------------
    def mstopk_cpu(self, x: np.ndarray, k: int, num_samplings: int = 30, random: int = 0, index_bits: int = 32,
                   threads: int = 0) -> TopK:
        """MSTopK's CPU functor on float32 x (1-D). Raises HarnessError on a bad argument."""
        x = np.ascontiguousarray(x, np.float32).reshape(-1)
        kk = max(0, min(int(k), x.size))
        values = np.empty(kk, np.float32)
        indices = np.empty(kk, _index_dtype(index_bits))
        thresholds = np.empty(2, np.float64)
        self.check("hvdx_mstopk_cpu", x.ctypes.data, x.size, int(k), num_samplings, random & (2**64 - 1),
                   values.ctypes.data, indices.ctypes.data, index_bits, thresholds.ctypes.data, threads)
        return TopK(values, indices.astype(np.int64), (float(thresholds[0]), float(thresholds[1])))

    def sparse_accumulate_cpu(self, values: np.ndarray, indices: np.ndarray, size: int,
                              dense: Optional[np.ndarray] = None, threads: int = 0) -> np.ndarray:
        """out = dense (zeros when None) + values at indices, float32; int32 or int64 indices."""
        values = np.ascontiguousarray(values, np.float32)
        indices = np.ascontiguousarray(indices)
        bits = 32 if indices.dtype == np.int32 else 64
        indices = indices.astype(_index_dtype(bits), copy=False)
        out = np.empty(size, np.float32)
        dense_ptr = None
        if dense is not None:
            dense = np.ascontiguousarray(dense, np.float32)
            dense_ptr = dense.ctypes.data
        self.check("hvdx_sparse_accumulate_cpu", values.ctypes.data, indices.ctypes.data, bits, values.size,
                   dense_ptr, out.ctypes.data, size, threads)
        return out

    def error_feedback_cpu(self, grads, residual: np.ndarray, velocity: Optional[np.ndarray] = None,
                           momentum: float = 0.0, decay: float = 1.0,
                           threads: int = 0) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """(acc, u') of error feedback's CPU functor on float32 arrays of one length."""
        grads = [np.ascontiguousarray(g, np.float32) for g in grads]
        residual = np.ascontiguousarray(residual, np.float32)
        n = residual.size
        table = (ctypes.c_void_p * len(grads))(*[g.ctypes.data for g in grads])
        acc = np.empty(n, np.float32)
        out = None if velocity is None else np.empty(n, np.float32)
        velocity = None if velocity is None else np.ascontiguousarray(velocity, np.float32)
        self.check("hvdx_error_feedback_cpu", table, len(grads), residual.ctypes.data,
                   None if velocity is None else velocity.ctypes.data, momentum, decay, acc.ctypes.data,
                   None if out is None else out.ctypes.data, n, threads)
        return acc, out

    def quantize_cpu(self, x: np.ndarray, bits: int, chunk: int, threads: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """(packed, dequantized) of the wire's quantize CPU functor on float32 x (1-D)."""
        x = np.ascontiguousarray(x, np.float32).reshape(-1)
        packed = np.empty(quantized_bytes(x.size, bits, chunk), np.uint8)
        dequantized = np.empty(x.size, np.float32)
        self.check("hvdx_quantize_cpu", x.ctypes.data, x.size, bits, chunk, packed.ctypes.data,
                   dequantized.ctypes.data, threads)
        return packed, dequantized

    def dequantize_cpu(self, packed: np.ndarray, n: int, bits: int, chunk: int, threads: int = 0) -> np.ndarray:
        """The n float32 values of quantize's packed bytes (CPU functor)."""
        packed = np.ascontiguousarray(packed, np.uint8)
        out = np.empty(n, np.float32)
        self.check("hvdx_dequantize_cpu", packed.ctypes.data, n, bits, chunk, out.ctypes.data, threads)
        return out

    # -- GPU ------------------------------------------------------------------------------
    def require_cuda(self) -> None:
        if not self.has_cuda:
            raise HarnessError(12, f"{self.path} was built without CUDA")

    def mstopk_gpu_scratch_bytes(self, d: int) -> int:
        return int(self.lib.hvdx_mstopk_gpu_scratch_bytes(d))

    def mstopk_gpu_raw(self, x: int, d: int, k: int, num_samplings: int, random: int, values: int, indices: int,
                       index_bits: int, thresholds: int, scratch: int, stream: int = 0) -> int:
        """Enqueues MSTopK's CUDA functor on device addresses; returns the status code
        (the message is self.last_message). Nothing is synchronised."""
        return self.call("hvdx_mstopk_gpu", x, d, k, num_samplings, random & (2**64 - 1), values, indices,
                         index_bits, thresholds, scratch, stream)

    def sparse_accumulate_gpu_workspace_bytes(self, nnz: int, size: int, index_bits: int) -> int:
        return int(self.lib.hvdx_sparse_accumulate_gpu_workspace_bytes(nnz, size, index_bits))

    def sparse_accumulate_gpu_raw(self, values: int, indices: int, index_bits: int, nnz: int, dense: Optional[int],
                                  out: int, size: int, workspace: Optional[int], stream: int = 0) -> int:
        return self.call("hvdx_sparse_accumulate_gpu", values, indices, index_bits, nnz, dense, out, size, workspace,
                         stream)

    def sync(self, stream: int = 0) -> None:
        """Waits for the stream; raises HarnessError with any error of its kernels."""
        self.check("hvdx_cuda_sync", stream)

    # -- GPU on NumPy arrays (no CuPy or PyTorch needed) -----------------------------------
    def mstopk_gpu(self, x: np.ndarray, k: int, num_samplings: int = 30, random: int = 0,
                   index_bits: int = 32) -> TopK:
        """MSTopK's CUDA functor on a copy of x on the GPU; synchronises and raises on error."""
        self.require_cuda()
        x = np.ascontiguousarray(x, np.float32).reshape(-1)
        d, kk = x.size, max(0, min(int(k), x.size))
        itype = _index_dtype(index_bits)
        with DeviceBuffer.upload(self, x) as dx, DeviceBuffer(self, kk * 4) as dv, \
                DeviceBuffer(self, kk * itype.itemsize) as di, DeviceBuffer(self, 16) as dt, \
                DeviceBuffer(self, self.mstopk_gpu_scratch_bytes(d)) as scratch:
            code = self.mstopk_gpu_raw(dx.ptr, d, int(k), num_samplings, random, dv.ptr, di.ptr, index_bits, dt.ptr,
                                       scratch.ptr)
            if code != 0:
                raise HarnessError(code, self.last_message)
            self.sync()
            values = dv.download(np.float32, kk)
            indices = di.download(itype, kk).astype(np.int64)
            thresholds = dt.download(np.float64, 2)
        return TopK(values, indices, (float(thresholds[0]), float(thresholds[1])))

    def sparse_accumulate_gpu(self, values: np.ndarray, indices: np.ndarray, size: int,
                              dense: Optional[np.ndarray] = None) -> np.ndarray:
        """Sparse accumulation's CUDA functor on copies on the GPU; synchronises, raises on error."""
        self.require_cuda()
        values = np.ascontiguousarray(values, np.float32)
        indices = np.ascontiguousarray(indices)
        bits = 32 if indices.dtype == np.int32 else 64
        indices = indices.astype(_index_dtype(bits), copy=False)
        nnz = values.size
        with DeviceBuffer.upload(self, values) as dv, DeviceBuffer.upload(self, indices) as di, \
                DeviceBuffer(self, size * 4) as dout, \
                DeviceBuffer(self, self.sparse_accumulate_gpu_workspace_bytes(nnz, size, bits)) as ws:
            dd = DeviceBuffer.upload(self, np.ascontiguousarray(dense, np.float32)) if dense is not None else None
            try:
                code = self.sparse_accumulate_gpu_raw(dv.ptr, di.ptr, bits, nnz, dd.ptr if dd else None, dout.ptr,
                                                      size, ws.ptr or None)
                if code != 0:
                    raise HarnessError(code, self.last_message)
                self.sync()
                return dout.download(np.float32, size)
            finally:
                if dd is not None:
                    dd.free()


    def error_feedback_gpu(self, grads, residual: np.ndarray, velocity: Optional[np.ndarray] = None,
                           momentum: float = 0.0, decay: float = 1.0) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Error feedback's CUDA functor on copies on the GPU; synchronises, raises on error."""
        self.require_cuda()
        residual = np.ascontiguousarray(residual, np.float32)
        n = residual.size
        buffers = [DeviceBuffer.upload(self, np.ascontiguousarray(g, np.float32)) for g in grads]
        buffers.append(DeviceBuffer.upload(self, residual))
        if velocity is not None:
            buffers.append(DeviceBuffer.upload(self, np.ascontiguousarray(velocity, np.float32)))
        acc, out = DeviceBuffer(self, 4 * n), DeviceBuffer(self, 4 * n if velocity is not None else 0)
        try:
            table = (ctypes.c_void_p * len(grads))(*[b.ptr for b in buffers[:len(grads)]])
            code = self.call("hvdx_error_feedback_gpu", table, len(grads), buffers[len(grads)].ptr,
                             buffers[-1].ptr if velocity is not None else None, momentum, decay, acc.ptr,
                             out.ptr or None, n, 0)
            if code != 0:
                raise HarnessError(code, self.last_message)
            self.sync()
            return acc.download(np.float32, n), (out.download(np.float32, n) if velocity is not None else None)
        finally:
            for b in [*buffers, acc, out]:
                b.free()


    def quantize_gpu(self, x: np.ndarray, bits: int, chunk: int) -> Tuple[np.ndarray, np.ndarray]:
        """quantize's CUDA functor on a copy of x on the GPU; synchronises, raises on error."""
        self.require_cuda()
        x = np.ascontiguousarray(x, np.float32).reshape(-1)
        nbytes = quantized_bytes(x.size, bits, chunk)
        with DeviceBuffer.upload(self, x) as dx, DeviceBuffer(self, nbytes) as dp, \
                DeviceBuffer(self, 4 * x.size) as dd:
            self.check("hvdx_quantize_gpu", dx.ptr, x.size, bits, chunk, dp.ptr or None, dd.ptr or None, 0)
            self.sync()
            return dp.download(np.uint8, nbytes), dd.download(np.float32, x.size)

    def dequantize_gpu(self, packed: np.ndarray, n: int, bits: int, chunk: int) -> np.ndarray:
        """dequantize's CUDA functor on a copy of packed on the GPU; synchronises, raises on error."""
        self.require_cuda()
        with DeviceBuffer.upload(self, np.ascontiguousarray(packed, np.uint8)) as dp, \
                DeviceBuffer(self, 4 * n) as dout:
            self.check("hvdx_dequantize_gpu", dp.ptr or None, n, bits, chunk, dout.ptr or None, 0)
            self.sync()
            return dout.download(np.float32, n)


def quantized_bytes(n: int, bits: int, chunk: int) -> int:
    """The packed bytes of n values at `bits` with a float32 scale per chunk (kernels/quantize.h)."""
    return n * bits // 8 + 4 * (n // chunk) if chunk > 0 else 0


class DeviceBuffer:
    """cudaMalloc'd bytes through the harness (a context manager that frees them)."""

    def __init__(self, harness: Harness, nbytes: int) -> None:
        self.harness, self.nbytes = harness, int(nbytes)
        ptr = ctypes.c_void_p()
        if self.nbytes > 0:
            harness.check("hvdx_cuda_malloc", ctypes.byref(ptr), self.nbytes)
        self.ptr = ptr.value or 0

    @classmethod
    def upload(cls, harness: Harness, array: np.ndarray) -> "DeviceBuffer":
        array = np.ascontiguousarray(array)
        buf = cls(harness, array.nbytes)
        if array.nbytes:
            harness.check("hvdx_cuda_memcpy", buf.ptr, array.ctypes.data, array.nbytes, 1)
        return buf

    def download(self, dtype: Any, count: int) -> np.ndarray:
        out = np.empty(count, dtype)
        if out.nbytes:
            self.harness.check("hvdx_cuda_memcpy", out.ctypes.data, self.ptr, out.nbytes, 2)
        return out

    def free(self) -> None:
        if self.ptr:
            self.harness.check("hvdx_cuda_free", self.ptr)
            self.ptr = 0

    def __enter__(self) -> "DeviceBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()
