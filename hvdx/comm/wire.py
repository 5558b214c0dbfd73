"""The wire format of the sparse strategies: (value, index) pairs in one 1-D packet.

One all-gather moves every sender's packet: its k values in the wire dtype, then its k
indices' bits reinterpreted as that dtype (int32 or int64; an int64 index takes two
float32 or four 16-bit slots). A float16 packet also carries a power-of-two scale:
values are divided by 2**e before the cast, with e chosen so that the largest finite
value fits (float16 overflows at 65504: a finite 1e5 would otherwise arrive as Inf and
poison training), and multiplied back on arrival. Powers of two are exact, so the only
error is float16's rounding, which the sender keeps in its residual (it subtracts what
the receivers decode, `decode_sent`). Inf and NaN stay what they are, so the loss scaler
still sees them.
"""
from __future__ import annotations

from typing import Sequence, Tuple, Union

import tensorflow as tf

__all__ = ["WIRE_DTYPES", "decode_sent", "pack", "packet_length", "unpack"]

WIRE_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
_FLOAT16_TOP = 14  # scale so that max|v| < 2**15 (float16's largest finite value is ~2**16)


def _exponent(values: tf.Tensor) -> tf.Tensor:
    """e >= 0 such that every finite |value| / 2**e < 2**15 (float32 scalar)."""
    magnitude = tf.abs(tf.cast(values, tf.float32))
    largest = tf.reduce_max(tf.where(tf.math.is_finite(magnitude), magnitude, tf.zeros_like(magnitude)))
    return tf.maximum(tf.math.ceil(tf.math.log(tf.maximum(largest, 1.0)) / tf.math.log(2.0)) - _FLOAT16_TOP, 0.0)


def _to_wire(values: tf.Tensor, wire: tf.DType) -> Tuple[tf.Tensor, tf.Tensor]:
    """(values on the wire, the scale exponent e as float32; 0 when unscaled)."""
    if wire != tf.float16:
        return tf.cast(values, wire), tf.zeros([], tf.float32)
    e = _exponent(values)
    return tf.cast(tf.cast(values, tf.float32) * tf.pow(2.0, -e), wire), e


def decode_sent(values: tf.Tensor, wire: tf.DType) -> tf.Tensor:
    """What the receivers will decode from `values` (in values' dtype)."""
    if wire == values.dtype:
        return values
    on_wire, e = _to_wire(values, wire)
    return tf.cast(tf.cast(on_wire, tf.float32) * tf.pow(2.0, e), values.dtype)


def _slots_per_index(index_dtype: tf.DType, wire: tf.DType) -> int:
    return index_dtype.size // wire.size


def pack(values: tf.Tensor, indices: tf.Tensor, wire: tf.DType) -> tf.Tensor:
    """One 1-D packet of dtype `wire`: values, index bits, and (float16) the exponent."""
    on_wire, e = _to_wire(values, wire)
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
    if not isinstance(k, int):
        lengths = [packet_length(kj, index_dtype, gathered.dtype) for kj in k]
        pairs = [unpack(packet, kj, index_dtype) for packet, kj in zip(tf.split(gathered, lengths), k)]
        return tf.concat([v for v, _ in pairs], 0), tf.concat([i for _, i in pairs], 0)
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
