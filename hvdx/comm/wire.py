"""The wire formats: the dtypes values may travel in, the float16 power-of-two scaling, the
(value, index) packets of the sparse strategies, and the low-bit integer codes with a float32
scale per chunk (`quantize`; LowBit's, streaming DiLoCo's, and the sparse strategies' values
with `value_bits`). DASO's blocking average uses the same dtypes and the same float16 scaling
(`hvdx.daso.sync`).

A packet is one 1-D tensor per sender: its k values in the wire dtype, then its k indices'
bits reinterpreted as that dtype (int32 or int64; an int64 index takes two float32 or four
16-bit slots). A float16 packet also carries a power-of-two exponent e: values are
multiplied by 2**-e before the cast so that the largest finite |value| is at most 2**14
(float16 overflows at 65504: a finite 1e5 would otherwise arrive as Inf and poison
training), and by 2**e on arrival. Powers of two are exact, so the only error is float16's
rounding, which the sender keeps in its residual (it subtracts what the receivers decode,
`decode_sent`). Inf and NaN stay what they are, so the loss scaler still sees them.

A quantized packet (`pack_quantized`) is bytes: the k values as 8- or 4-bit codes with a
float32 scale per chunk of at most VALUE_CHUNK values (`value_chunking`: the chunks of one
packet equal, padded with zeros), then the indices' bytes. Integers of several senders cannot
be summed without overflow: such packets travel by all-gather, as every packet here does.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple, Union

import tensorflow as tf

from hvdx import ops
from hvdx.arguments import integer, is_integer

__all__ = ["BITS", "DEFAULT_CHUNK", "VALUE_CHUNK", "WIRE_DTYPES", "check_bits", "check_chunk", "check_dtype",
           "decode_sent", "dequantize", "float16_exponent", "pack", "pack_quantized", "packet_length",
           "quantize", "quantized_packet_length", "to_wire", "unpack", "unpack_quantized", "value_chunking"]

#: The dtypes values may travel in.
WIRE_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
_FLOAT16_TOP = 14  # scaled magnitudes stay <= 2**14 (float16's largest finite value is ~2**16)


def check_dtype(value: Any, argument: str = "wire_dtype") -> tf.DType:
    """`value` (a tf/NumPy dtype or its name) as one of WIRE_DTYPES.

    Raises:
      ValueError: naming `argument`, for any other value.
    """
    try:
        dtype = tf.as_dtype(value)
    except TypeError:
        dtype = None
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"{argument} must be one of {[d.name for d in WIRE_DTYPES]}, got {value!r}")
    return dtype


def float16_exponent(values: tf.Tensor, upscale: bool = False) -> tf.Tensor:
    """The exponent e (a float32 scalar) with max finite |values| * 2**-e <= 2**14.

    upscale=False: e >= 0 (small values are sent as they are). True: e may be negative (down
    to -94, so 2**-e fits float32), so that small values use float16's full precision
    instead of its subnormals; e = 0 when every value is zero or non-finite."""
    magnitude = tf.abs(tf.cast(values, tf.float32))
    largest = tf.reduce_max(tf.where(tf.math.is_finite(magnitude), magnitude, tf.zeros_like(magnitude)))
    if not upscale:
        return tf.maximum(tf.math.ceil(tf.math.log(tf.maximum(largest, 1.0)) / tf.math.log(2.0)) - _FLOAT16_TOP, 0.0)
    e = tf.math.ceil(tf.math.log(tf.maximum(largest, 2.0 ** -80)) / tf.math.log(2.0)) - _FLOAT16_TOP
    return tf.where(largest > 0, e, 0.0)


def to_wire(values: tf.Tensor, wire: tf.DType, upscale: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
    """(values in dtype `wire`, the float16 exponent e as float32; 0 for the other dtypes).
    The receiver decodes float32(values) * 2**e."""
    if wire != tf.float16:
        return tf.cast(values, wire), tf.zeros([], tf.float32)
    e = float16_exponent(values, upscale)
    return tf.cast(tf.cast(values, tf.float32) * tf.pow(2.0, -e), wire), e


def decode_sent(values: tf.Tensor, wire: tf.DType) -> tf.Tensor:
    """What the receivers will decode from `values` (in values' dtype)."""
    if wire == values.dtype:
        return values
    on_wire, e = to_wire(values, wire)
    return tf.cast(tf.cast(on_wire, tf.float32) * tf.pow(2.0, e), values.dtype)


def _slots_per_index(index_dtype: tf.DType, wire: tf.DType) -> int:
    return index_dtype.size // wire.size


def pack(values: tf.Tensor, indices: tf.Tensor, wire: tf.DType) -> tf.Tensor:
    """One 1-D packet of dtype `wire`: values, index bits, and (float16) the exponent."""
    on_wire, e = to_wire(values, wire)
    index_bits = tf.reshape(tf.bitcast(indices, wire), [-1])
    parts = [on_wire, index_bits]
    if wire == tf.float16:
        parts.append(tf.reshape(tf.cast(e, wire), [1]))  # a small integer: exact in float16
    return tf.concat(parts, axis=0)


def packet_length(k: int, index_dtype: tf.DType, wire: tf.DType) -> int:
    """Elements of one sender's packet of k pairs."""
    return k * (1 + _slots_per_index(index_dtype, wire)) + (1 if wire == tf.float16 else 0)


def unpack(gathered: tf.Tensor, k: Union[int, Sequence[int]], index_dtype: tf.DType) -> Tuple[tf.Tensor, tf.Tensor]:
    """Inverse of `pack` for the concatenation of every sender's packet: (float32 values,
    indices of `index_dtype`), senders in order. `k`: pairs per packet, or one count per
    sender where senders send different numbers of pairs."""
    if not is_integer(k):
        lengths = [packet_length(kj, index_dtype, gathered.dtype) for kj in k]
        pairs = [unpack(packet, kj, index_dtype) for packet, kj in zip(tf.split(gathered, lengths), k)]
        return tf.concat([v for v, _ in pairs], 0), tf.concat([i for _, i in pairs], 0)
    k = int(k)
    wire = gathered.dtype
    per_index = _slots_per_index(index_dtype, wire)
    extra = 1 if wire == tf.float16 else 0
    packets = tf.reshape(gathered, [-1, packet_length(k, index_dtype, wire)])
    values = tf.cast(packets[:, :k], tf.float32)
    if extra:
        values = values * tf.pow(2.0, tf.cast(packets[:, -1:], tf.float32))
    index_bits = packets[:, k:k * (1 + per_index)]
    if per_index > 1:
        index_bits = tf.reshape(index_bits, [-1, k, per_index])
    indices = tf.bitcast(index_bits, index_dtype)
    return tf.reshape(values, [-1]), tf.reshape(indices, [-1])


#: The widths a value may take on the wire.
BITS = (8, 4)
#: Elements per scale when none is given: the scale's 4 bytes add 0.4 % to 8-bit chunks.
DEFAULT_CHUNK = 1024


def check_bits(bits: Any, *, optional: bool = False) -> Optional[int]:
    """`bits` as an int of BITS (or None where `optional`: float32 on the wire); ValueError
    otherwise."""
    if optional and bits is None:
        return None
    allowed = f"{'None (float32), ' if optional else ''}one of {BITS}"
    value = integer(bits, "bits", 1, expected=allowed)
    if value not in BITS:
        raise ValueError(f"bits must be {allowed}, got {bits!r}")
    return value


def check_chunk(chunk: Any) -> int:
    """`chunk` (elements per float32 scale) as an even int >= 2; ValueError otherwise."""
    value = integer(chunk, "chunk", 2, expected="an even int >= 2 (elements per scale)")
    if value % 2:
        raise ValueError(f"chunk must be an even int >= 2 (elements per scale), got {chunk!r}")
    return value


def _levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize(x: tf.Tensor, bits: int, chunk: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """(the packed bytes, the dequantized values) of a 1-D float32 `x` of a length that is a
    multiple of `chunk`: per chunk s = max|x| / L, q = round(x / s) (half to even; 0 where s is
    0), bytes = the q as int8 (8 bits) or two 4-bit codes q + 8 to a byte (4 bits), then the
    scales' float32 bytes. A non-finite x makes its chunk's scale non-finite. hvdx's one-pass
    kernel (`hvdx.ops.quantize`, CPU and CUDA), else TensorFlow's element-wise ops (a GPU job
    with an op library built without CUDA): the same bytes, and the same values up to the sign
    of a zero."""
    if _one_pass_kernels():
        return ops.quantize(x, bits, chunk)
    rows = tf.reshape(x, [-1, chunk])
    level = float(_levels(bits))
    scale = tf.reduce_max(tf.abs(rows), axis=1) / level
    q = tf.clip_by_value(tf.round(tf.math.divide_no_nan(rows, scale[:, None])), -level, level)
    dequantized = tf.reshape(q * scale[:, None], [-1])
    if bits == 8:
        codes = tf.bitcast(tf.cast(tf.reshape(q, [-1]), tf.int8), tf.uint8)
    else:
        nibbles = tf.reshape(tf.cast(q + 8.0, tf.uint8), [-1, 2])
        codes = nibbles[:, 0] * 16 + nibbles[:, 1]
    scales = tf.reshape(tf.bitcast(scale, tf.uint8), [-1])
    return tf.concat([codes, scales], axis=0), dequantized


def dequantize(packed: tf.Tensor, length: int, bits: int, chunk: int) -> tf.Tensor:
    """The `length` float32 values of `quantize`'s bytes (`length` a multiple of `chunk`)."""
    if _one_pass_kernels():
        return tf.ensure_shape(ops.dequantize(packed, bits, chunk), [length])
    code_bytes = length if bits == 8 else length // 2
    codes, scales = packed[:code_bytes], packed[code_bytes:]
    if bits == 8:
        q = tf.cast(tf.bitcast(codes, tf.int8), tf.float32)
    else:
        q = tf.cast(tf.reshape(tf.stack([codes // 16, codes % 16], axis=1), [-1]), tf.float32) - 8.0
    scale = tf.bitcast(tf.reshape(scales, [-1, 4]), tf.float32)
    return tf.reshape(tf.reshape(q, [-1, chunk]) * scale[:, None], [-1])


def _one_pass_kernels() -> bool:
    """Whether `quantize` / `dequantize` run hvdx's kernels: where TensorFlow sees no GPU, or
    the op library has its CUDA kernels (built without them, the op would run on the CPU and
    copy a GPU step's values across; TensorFlow's element-wise ops stay on the GPU)."""
    return not tf.config.list_logical_devices("GPU") or bool(ops.build_info().get("cuda"))


#: The most values of a quantized packet that share one scale (`value_chunking`).
VALUE_CHUNK = 256


def value_chunking(k: int) -> Tuple[int, int]:
    """(chunk, padded length) of a quantized packet of k values: ceil(k / VALUE_CHUNK) equal
    chunks of an even length (the 4-bit codes go two to a byte), so the padding is under two
    values per chunk."""
    chunks = max(1, math.ceil(k / VALUE_CHUNK))
    chunk = math.ceil(k / chunks)
    chunk += chunk % 2
    return chunk, chunk * chunks


def _value_bytes(k: int, bits: int) -> Tuple[int, int, int, int]:
    """(chunk, padded length, code bytes, scale bytes) of a quantized packet's k values."""
    chunk, padded = value_chunking(k)
    return chunk, padded, padded if bits == 8 else padded // 2, 4 * (padded // chunk)


def quantized_packet_length(k: int, index_dtype: tf.DType, bits: int) -> int:
    """Bytes of one sender's quantized packet of k pairs."""
    _, _, code_bytes, scale_bytes = _value_bytes(k, bits)
    return code_bytes + scale_bytes + k * index_dtype.size


def pack_quantized(values: tf.Tensor, indices: tf.Tensor, bits: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """(one 1-D uint8 packet: the k values' codes and scales, then the indices' bytes; the
    float32 values the receivers will decode, which the sender keeps out of its residual)."""
    k = int(values.shape[0])
    chunk, padded = value_chunking(k)
    values = tf.cast(values, tf.float32)
    codes, decoded = quantize(tf.pad(values, [[0, padded - k]]) if padded != k else values, bits, chunk)
    index_bytes = tf.reshape(tf.bitcast(indices, tf.uint8), [-1])
    return tf.concat([codes, index_bytes], axis=0), decoded[:k]


def unpack_quantized(gathered: tf.Tensor, k: Union[int, Sequence[int]], index_dtype: tf.DType, bits: int,
                     senders: Optional[int] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """Inverse of `pack_quantized` for the concatenation of every sender's packet: (float32
    values, indices of `index_dtype`), senders in order. `k`: pairs per packet (then `senders`
    packets, or as many as `gathered` holds), or one count per sender."""
    if is_integer(k):
        count = senders if senders is not None else int(gathered.shape[0]) // quantized_packet_length(
            int(k), index_dtype, bits)
        k = [int(k)] * count
    if len(set(k)) == 1:  # equal packets (a cross set's): one decode of them all
        return _unpack_equal(gathered, len(k), int(k[0]), index_dtype, bits)
    lengths = [quantized_packet_length(kj, index_dtype, bits) for kj in k]
    pairs = [_unpack_equal(packet, 1, kj, index_dtype, bits) for packet, kj in zip(tf.split(gathered, lengths), k)]
    return tf.concat([v for v, _ in pairs], 0), tf.concat([i for _, i in pairs], 0)


def _unpack_equal(gathered: tf.Tensor, senders: int, k: int, index_dtype: tf.DType, bits: int
                  ) -> Tuple[tf.Tensor, tf.Tensor]:
    """`unpack_quantized` of `senders` packets of k pairs each: their codes and scales side by
    side are one `quantize` output of senders x padded values (each packet's chunks are whole)."""
    chunk, padded, code_bytes, scale_bytes = _value_bytes(k, bits)
    packets = tf.reshape(gathered, [senders, quantized_packet_length(k, index_dtype, bits)])
    codes = tf.reshape(packets[:, :code_bytes], [-1])
    scales = tf.reshape(packets[:, code_bytes:code_bytes + scale_bytes], [-1])
    values = tf.reshape(dequantize(tf.concat([codes, scales], 0), senders * padded, bits, chunk), [senders, padded])
    indices = tf.bitcast(tf.reshape(packets[:, code_bytes + scale_bytes:], [senders, k, index_dtype.size]), index_dtype)
    return tf.reshape(values[:, :k], [-1]), tf.reshape(indices, [-1])
