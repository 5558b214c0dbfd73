"""Streaming DiLoCo (hvdx/streaming_diloco.py) on every rank of an m x n Horovod job. Run by
tests/test_streaming_diloco.py through the suite (tests/multirank/suite.py): `CHECKS` below,
each returning what the test asserts on.
"""
import numpy as np
import tensorflow as tf

from hvdx.callbacks import TrainingMethodCallback
from hvdx.streaming_diloco import StreamingDiLoCo
from tests.multirank import digits
from tests.multirank.rank import spread

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _local(rank: int) -> np.ndarray:
    return (np.arange(40, dtype=np.float32) * (rank + 1) - rank).astype(np.float32)


def check_mean(topo):
    """One fragment, H = 1, outer SGD(1.0), no overlap: a synchronisation sets every rank's
    variable to the mean over ranks of their values, through the hierarchical wire (node sum,
    then across nodes) and the flat one, at 32, 8 and 4 bits (chunk 16)."""
    out, finals = {"size": topo.size, "nodes": topo.num_nodes}, []
    for wire, hierarchical in (("hierarchical", True), ("flat", False)):
        if hierarchical:
            sums = [sum(_local(r) for r in node) for node in topo.node_ranks]
        else:
            sums = [_local(r) for r in range(topo.size)]
        out[wire] = {"max_node_sum": float(np.max(np.abs(sums)))}
        for bits in (None, 8, 4):
            var = tf.Variable(np.zeros(40, np.float32))
            method = StreamingDiLoCo(sync_every=1, fragments=1, overlap=0, bits=bits, chunk=16,
                                     hierarchical=hierarchical,
                                     outer_optimizer=tf.keras.optimizers.SGD(1.0)).start([var])
            var.assign(_local(topo.rank))
            method.after_step()
            out[wire][str(bits or 32)] = var.numpy().tolist()
            finals.append(var.numpy())
            if hierarchical and bits == 4:
                out["bytes"] = method.stats()["bytes_sent"]
            method.close()
    out["spread"] = spread(finals, "streaming_diloco.mean")
    return out


def check_fit(topo, epochs=6, batch=16):
    """The digits MLP in Model.fit through the one callback: every rank its own shard and
    initial weights (start() takes rank 0's), H = 8 in 2 fragments with one step of overlap
    and 4-bit outer gradients across nodes; the epochs end synchronised. The test asks for
    0.8 test accuracy and one model on every rank."""
    x_train, x_test, y_train, y_test = digits.split()
    shard = slice(topo.rank, len(x_train) - len(x_train) % topo.size, topo.size)
    model = digits.mlp(seed=topo.rank)
    model.compile(tf.keras.optimizers.SGD(0.05, momentum=0.9), LOSS, metrics=["accuracy"])
    driver = TrainingMethodCallback(StreamingDiLoCo(sync_every=8, fragments=2, overlap=1, bits=4))
    tf.keras.utils.set_random_seed(1 + topo.rank)
    model.fit(x_train[shard], y_train[shard], batch_size=batch, epochs=epochs, verbose=0, callbacks=[driver])
    accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
    return {"accuracy": accuracy, "spread": spread(model.get_weights(), "streaming_diloco.fit"),
            "stats": driver.stats, "epochs": epochs}


CHECKS = {"mean": check_mean, "fit": check_fit}
