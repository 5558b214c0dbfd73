"""hvdx.comm strategies average like allreduce, and the sparse ones follow Algorithms 1-2
(tests/multirank/check_comm.py asserts on every rank); ranks that call a strategy
differently get an error, not a hang or a wrong average; a buffer of no elements comes
back as it is."""
import pytest
import tensorflow as tf

import hvdx
from hvdx import comm
from tests import suite


@suite.runs(suite.check("comm.strategies", "2x2"), suite.check("comm.strategies", "3x2"))
def test_strategies_on_hierarchical_topologies(ranks):
    assert sorted(ranks) == list(range(ranks.topology.np))


@suite.runs(suite.check("comm.disagreement", "2x2", timeout=90))
def test_ranks_calling_a_strategy_differently_all_get_an_error_naming_what_differs(ranks):
    """Issue 27, item 11: a strategy called directly on a buffer checks, once per layout,
    that every rank makes the same call; rank 0 differs in one thing per case."""
    want = {"strategy": "strategy=", "elements": "buffer elements=1200 (rank 0: 1000)", "density": "density=0.05",
            "dtype": "buffer dtype=float32 (rank 0: float64)", "wire_dtype": "wire_dtype=float32",
            "pieces": "buffer pieces=[500, 500] (rank 0: [400, 600])", "name": "buffer name=h (rank 0: g)",
            "tape_vs_direct": "rank 1:"}
    for result in ranks.every():
        assert sorted(result["messages"]) == sorted(want)
        for case, words in want.items():
            message = result["messages"][case]
            assert words in message, (case, message)
            assert all(f"rank {r}:" in message for r in (1, 2, 3)), (case, message)  # every other rank named
        assert result["direct_checks"] == 1  # three calls on one layout: one collective check
        assert result["buckets"] > 1 and result["tape_checks"] == 1  # the tape's steps: one check in all
        assert result["finite"]


@pytest.fixture(scope="module")
def one_rank():
    return hvdx.init()


@pytest.mark.parametrize("communication", comm.names())
def test_a_gradient_of_no_elements_comes_back_empty_through_the_tape(one_rank, communication):
    """Issue 27, item 10 (Horovod's tape returns [[1.0, 1.0], []]): a zero-size variable
    beside a normal one."""
    kept = tf.Variable([1.0, 2.0])
    empty = tf.Variable(tf.zeros([0]))
    density = {"density": 1.0} if "density" in comm.strategy_class(communication).options else {}
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(kept) + tf.reduce_sum(empty)
    grads = hvdx.DistributedGradientTape(tape, communication=communication, **density).gradient(loss, [kept, empty])
    assert [g.numpy().tolist() for g in grads] == [[1.0, 1.0], []]
    strategy = comm.get(communication, **density)
    assert strategy(tf.zeros([0])).shape == (0,)
    pieces, _ = strategy.aggregate_pieces([tf.zeros([0]), tf.zeros([0])], "empty_pieces")
    assert [p.shape for p in pieces] == [(0,), (0,)]


class WithEmptyWeight(tf.keras.layers.Layer):
    """Adds the sum of a weight of no elements (0) to its input."""

    def build(self, input_shape):
        self.empty = self.add_weight(name="empty", shape=[0], initializer="zeros")

    def call(self, x):
        return x + tf.reduce_sum(self.empty)


@pytest.mark.parametrize("communication", comm.names())
def test_model_fit_trains_beside_a_weight_of_no_elements(one_rank, communication):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2), WithEmptyWeight()])
    density = {"density": 1.0} if "density" in comm.strategy_class(communication).options else {}
    model.compile(optimizer=hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication=communication,
                                                      **density), loss="mse")
    before = model.layers[0].kernel.numpy()
    history = model.fit(tf.ones([8, 4]), tf.zeros([8, 2]), epochs=2, batch_size=4, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    assert (model.layers[0].kernel.numpy() != before).any()
    assert model.layers[1].empty.shape == (0,)
