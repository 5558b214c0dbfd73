"""The wire formats: the dtypes values may travel in, the float16 power-of-two scaling, and
the (value, index) packets of the sparse strategies. DASO's blocking average uses the same
dtypes and the same float16 scaling (`hvdx.daso.sync`).

A packet is one 1-D tensor per sender: its k values in the wire dtype, then its k indices'
bits reinterpreted as that dtype (int32 or int64; an int64 index takes two float32 or four
16-bit slots). A float16 packet also carries a power-of-two exponent e: values are
multiplied by 2**-e before the cast so that the largest finite |value| is at most 2**14
(float16 overflows at 65504: a finite 1e5 would otherwise arrive as Inf and poison
training), and by 2**e on arrival. Powers of two are exact, so the only error is float16's
rounding, which the sender keeps in its residual (it subtracts what the receivers decode,
`decode_sent`). Inf and NaN stay what they are, so the loss scaler still sees them.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple, Union

import tensorflow as tf

from hvdx.arguments import is_integer

__all__ = ["WIRE_DTYPES", "check_dtype", "decode_sent", "float16_exponent", "pack", "packet_length", "to_wire",
           "unpack"]

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
