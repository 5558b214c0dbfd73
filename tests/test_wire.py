"""The sparse strategies' wire format (hvdx.comm.wire): every index type in every wire
type round-trips, float16 packets carry values beyond float16's range, and quantized packets
(8- and 4-bit values) round-trip to what their senders decoded."""
import numpy as np
import pytest
import tensorflow as tf

from hvdx.comm import wire
from tests import suite


@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("wire_dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_packets_of_several_senders_round_trip(index_dtype, wire_dtype):
    rng = np.random.default_rng(0)
    k, senders = 7, 3
    values = [rng.standard_normal(k).astype(np.float32) * 100 for _ in range(senders)]
    # int64 indices beyond 2**31, as a bucket of d >= 2**31 elements would select
    big = 2 ** 33 if index_dtype == tf.int64 else 2 ** 30
    indices = [rng.integers(0, big, k) for _ in range(senders)]
    packets = [wire.pack(tf.constant(v), tf.constant(i, index_dtype), wire_dtype) for v, i in zip(values, indices)]
    got_values, got_indices = wire.unpack(tf.concat(packets, 0), k, index_dtype)
    assert got_indices.dtype == index_dtype
    np.testing.assert_array_equal(got_indices.numpy(), np.concatenate(indices))
    sent = np.concatenate([wire.decode_sent(tf.constant(v), wire_dtype).numpy() for v in values])
    np.testing.assert_array_equal(got_values.numpy(), sent)  # receivers decode what senders subtract
    np.testing.assert_allclose(got_values.numpy(), np.concatenate(values), rtol=1e-2 if wire_dtype != tf.float32 else 0)


def test_float16_wire_scales_large_values_and_keeps_inf_nan():
    values = tf.constant([1e5, -3e6, 0.5, np.inf, np.nan], tf.float32)
    got, _ = wire.unpack(wire.pack(values, tf.range(5), tf.float16), 5, tf.int32)
    got = got.numpy()
    assert np.isfinite(got[:3]).all()
    np.testing.assert_allclose(got[:2], [1e5, -3e6], rtol=1e-3)
    assert np.isposinf(got[3]) and np.isnan(got[4])


def test_wire_dtypes_are_checked_in_one_place():
    """The sparse strategies, 2DTAR, the dense allreduce and DASO's blocking average accept
    the same dtypes, by object or name, and reject others naming the argument."""
    for value in (tf.float16, "bfloat16", np.float32):
        assert wire.check_dtype(value) in wire.WIRE_DTYPES
    for bad in ("int8", "float64", "fp8", 3):
        with pytest.raises(ValueError, match="blocking_wire_dtype must be one of"):
            wire.check_dtype(bad, "blocking_wire_dtype")


def test_float16_upscaling_keeps_small_values_out_of_subnormals():
    """With upscale (DASO's changes), values far below float16's normal range (6.1e-5) keep
    float16's 11 significant bits; without it (sparse packets) they are sent as they are."""
    values = tf.constant(np.linspace(-3e-7, 4e-7, 101, dtype=np.float32))
    on_wire, e = wire.to_wire(values, tf.float16, upscale=True)
    decoded = tf.cast(on_wire, tf.float32).numpy() * 2.0 ** e.numpy()
    assert e.numpy() < 0 and np.abs(on_wire.numpy()).max() <= 2 ** 14
    np.testing.assert_allclose(decoded, values.numpy(), rtol=2 ** -11, atol=0)
    plain, e0 = wire.to_wire(values, tf.float16)
    assert e0.numpy() == 0 and np.abs(tf.cast(plain, tf.float32).numpy() - values.numpy()).max() > 1e-9
    zeros, ez = wire.to_wire(tf.zeros([4]), tf.float16, upscale=True)
    assert ez.numpy() == 0 and not np.any(zeros.numpy())
    huge, eh = wire.to_wire(tf.constant([1e30, -2.0, np.inf]), tf.float16, upscale=True)
    assert np.isfinite(eh.numpy()) and np.isinf(huge.numpy()[2]) and np.isfinite(huge.numpy()[:2]).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
def test_quantized_packets_of_senders_with_different_k_round_trip(bits, index_dtype):
    """Top-k values as integer codes (`value_bits`): the indices come back exactly, the values
    as the sender decoded them (what it keeps out of its residual), each within half a step
    of its chunk's scale; senders may send different numbers of pairs."""
    rng = np.random.default_rng(1)
    ks = [1, 7, 256, 257, 1000]
    values = [rng.standard_normal(k).astype(np.float32) * 10 for k in ks]
    indices = [rng.integers(0, 2 ** 33 if index_dtype == tf.int64 else 2 ** 30, k) for k in ks]
    packed = [wire.pack_quantized(tf.constant(v), tf.constant(i, index_dtype), bits) for v, i in zip(values, indices)]
    assert [int(p.shape[0]) for p, _ in packed] == [wire.quantized_packet_length(k, index_dtype, bits) for k in ks]
    got_values, got_indices = wire.unpack_quantized(tf.concat([p for p, _ in packed], 0), ks, index_dtype, bits)
    np.testing.assert_array_equal(got_indices.numpy(), np.concatenate(indices))
    np.testing.assert_array_equal(got_values.numpy(), np.concatenate([d.numpy() for _, d in packed]))
    level = 2 ** (bits - 1) - 1
    for v, (_, decoded), k in zip(values, packed, ks):
        chunk, _ = wire.value_chunking(k)
        scales = np.repeat([np.abs(v[j:j + chunk]).max() / level for j in range(0, k, chunk)], chunk)[:k]
        assert np.all(np.abs(decoded.numpy() - v) <= scales / 2 + 1e-6)
    # senders of equal k (a cross set's) are decoded together: each still gets its own scales
    equal = [(rng.standard_normal(257) * 10 ** j).astype(np.float32) for j in range(3)]
    at = [rng.integers(0, 1000, 257) for _ in equal]
    made = [wire.pack_quantized(tf.constant(v), tf.constant(i, index_dtype), bits) for v, i in zip(equal, at)]
    again, where = wire.unpack_quantized(tf.concat([p for p, _ in made], 0), 257, index_dtype, bits, senders=3)
    np.testing.assert_array_equal(again.numpy(), np.concatenate([d.numpy() for _, d in made]))
    np.testing.assert_array_equal(where.numpy(), np.concatenate(at))


def test_value_chunks_are_even_and_pad_under_two_values_each():
    for k in (1, 2, 255, 256, 257, 511, 4097, 84_000):
        chunk, padded = wire.value_chunking(k)
        assert chunk % 2 == 0 and chunk <= wire.VALUE_CHUNK and padded % chunk == 0
        assert 0 <= padded - k < 2 * (padded // chunk)
    # 8-bit values and int32 indices: 5 bytes a pair and a scale per chunk, against float32's 8
    assert wire.quantized_packet_length(1000, tf.int32, 8) == 1000 + 4 * 4 + 4000


# -- the sparse strategies with value_bits, one rank (2 nodes x 2 ranks: tests/multirank/check_comm.py) --

@pytest.fixture(scope="module")
def one_rank():
    import hvdx

    return hvdx.init()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("strategy_name", ["hitopk", "sparse_allgather"])
@pytest.mark.parametrize("traced", [False, True])
def test_quantized_top_k_values_keep_what_the_codes_rounded_away_in_the_residual(one_rank, strategy_name, bits,
                                                                                 traced):
    """Error feedback (shi2021 eq. 5) over the codes: after T steps on one rank, the outputs
    plus the residual sum to the gradients, the residual holding the unsent entries and the
    codes' rounding of the sent ones."""
    from hvdx import comm

    strategy = comm.get(strategy_name, density=0.05, value_bits=bits, dense_below=0)
    call = tf.function(lambda g: strategy(g, "b")) if traced else (lambda g: strategy(g, "b"))
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(6)]
    sent = [call(tf.constant(g)).numpy() for g in grads]
    assert all(np.count_nonzero(s) <= 50 for s in sent)  # k = 50 pairs a step
    np.testing.assert_allclose(sum(sent) + strategy.variables["b"].numpy(), sum(grads), atol=1e-4)
    exact = comm.get(strategy_name, density=0.05, dense_below=0)
    first = exact(tf.constant(grads[0]), "b").numpy()
    assert np.array_equal(first != 0, sent[0] != 0) and not np.array_equal(first, sent[0])  # same pairs, rounded
    np.testing.assert_allclose(sent[0], first, atol=np.abs(first).max() / (2 ** (bits - 1) - 1))


def test_value_bits_is_an_option_of_the_optimizer_and_refused_beside_another_wire_dtype(one_rank):
    import hvdx
    from hvdx import comm

    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="hitopk", value_bits=4)
    config = opt.get_config()
    assert config["value_bits"] == 4 and type(opt).from_config(config).communication.value_bits == 4
    assert "value_bits=4" in repr(opt.communication)
    assert "value_bits" not in hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="hitopk"
                                                         ).get_config()  # None: its quiet default
    with pytest.raises(ValueError, match="value_bits=8 and wire_dtype=float16 both say how the values travel"):
        comm.HiTopK(value_bits=8, wire_dtype=tf.float16)
    for bad in (2, 8.5, "8", True):
        with pytest.raises(ValueError, match="bits"):
            comm.SparseAllgather(value_bits=bad)
    with pytest.raises(ValueError):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="allreduce", value_bits=8)


@suite.runs(suite.check("compressors.compressors", "2x2", timeout=300))
def test_hitopk_with_8_bit_values_trains_on_two_nodes_with_the_training_path_guarantees(ranks):
    """Every rank of 2 nodes x 2 ranks, HiTopK with value_bits=8: model.fit under
    mixed_float16 with backward_passes_per_step=2 keeps identical weights, lowers the loss,
    and a checkpoint per rank restores its residuals."""
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        fit = data["fit"]["hitopk_value_bits8"]
        assert fit["same_weights"] and fit["finite"] and fit["restored"] and fit["nonzero_residuals"] > 0, (rank, fit)
        assert fit["loss"][-1] < 0.6 * fit["loss"][0], (rank, fit)
