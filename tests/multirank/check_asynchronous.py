"""hvdx.asynchronous on every rank of an m x n Horovod job: one shared model per node
(gimpel2010 Algorithm 1; kungurtsev2021's ASSM, PASSM, PASSM+), claim by claim. Run by
tests/test_asynchronous.py through the suite (tests/multirank/suite.py): `CHECKS` below,
each returning what the test asserts on. Every check ends in a collective (`finish()` or a
barrier); every rank issues the same collectives in the same order.
"""
import os
import tempfile

import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import hvdx
from hvdx import ops
from hvdx.asynchronous import ASSM, PASSM, AsyncMiniBatch, PASSMPlus, SharedModelCallback
from hvdx.variables import slot_variables
from hvdx.zoo import mlp
from tests.multirank import digits
from tests.multirank.rank import spread

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model(seed=0, width=64, depth=1):
    return mlp(64, (width,) * depth, seed=seed)


# -- no lost update: the node's processes add known increments concurrently --------------------------
def check_no_lost_update(topo, rounds=100):
    model = make_model(width=256, depth=3)          # ~150k elements, 4 blocks (layers) of different sizes
    method = ASSM().start(model)
    n = method.shared.size
    hvdx.barrier()  # the creator unlinks after its own wait for the attachers: look once every start returned
    unlinked = not method.shared.path.exists()
    increments = {}
    for mode in ("atomic", "block", "whole"):
        delta = tf.fill([n], float(topo.local_rank + 1))
        if topo.local_rank == 0:
            method.shared.params[:] = 0.0            # integers from here on: every sum is exact in float32
        hvdx.barrier()                               # the node's processes start together
        for _ in range(rounds):
            ops.shared_update(method._address, delta, 0, mode)
        hvdx.barrier()                               # every process of every node is done
        after = ops.shared_read(method._address)[0].numpy()
        expected = rounds * sum(range(1, topo.local_size + 1))
        increments[mode] = float(np.max(np.abs(after - expected)))
        hvdx.barrier()                               # nobody starts the next mode before all read
    version = method.shared.updates
    method.close()
    hvdx.barrier()
    return {"error": increments, "version": version, "unlinked_after_start": unlinked,
            "expected_version": 3 * rounds * topo.local_size}


# -- convergence on the digits at equal epochs -------------------------------------------------------
def equal_shard(topo, n):
    return slice(topo.rank, n - n % topo.size, topo.size)


def check_convergence(topo, epochs=20, batch=16, lr=0.05, momentum=0.9):
    x_train, x_test, y_train, y_test = digits.split()
    shard = equal_shard(topo, len(x_train))
    steps_per_epoch = len(x_train[shard]) // batch + (len(x_train[shard]) % batch > 0)
    decay = 2 * epochs // 3   # the rate x0.1 at 2/3 of the epochs, every method (each rank counts its steps)

    def sgd():
        rate = tf.keras.optimizers.schedules.PiecewiseConstantDecay([decay * steps_per_epoch], [lr, lr * 0.1])
        return tf.keras.optimizers.SGD(rate, momentum=momentum)
    results, stats = {}, {}
    methods = {"AsyncMiniBatch": lambda: AsyncMiniBatch(average_every=20),
               "ASSM": lambda: ASSM(average_every=20), "PASSM": lambda: PASSM(average_every=20),
               "PASSM+": lambda: PASSMPlus(PASSMPlus.paper_schedule(epochs, decays=[decay]), average_every=20)}
    for label in ["sync"] + list(methods):
        model = make_model(depth=2)
        if label == "sync":
            opt = hvd_keras.DistributedOptimizer(sgd())
            callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)]
        else:
            opt = sgd()
            callback = SharedModelCallback(methods[label]())
            callbacks = [callback]
        model.compile(opt, LOSS, metrics=["accuracy"])
        tf.keras.utils.set_random_seed(1 + topo.rank)
        model.fit(x_train[shard], y_train[shard], batch_size=batch, epochs=epochs, verbose=0, callbacks=callbacks)
        results[label] = float(model.evaluate(x_test, y_test, verbose=0)[1])
        results[f"{label}_spread"] = spread(model.get_weights(), label)
        if label != "sync":
            stats[label] = callback.stats
    return {"accuracy": results, "stats": stats}


# -- PASSM's blocks on the node, restricted backprop, checkpoints -------------------------------------
def check_partition(topo):
    model = make_model(width=32, depth=3)
    method = PASSM().start(model, tf.keras.optimizers.SGD(0.1))
    own = method.own_range()
    names = [v.name for v in method.variables_to_train()]
    total = method.shared.size
    x, y = digits.split()[0][:32], digits.split()[2][:32]
    with tf.GradientTape(persistent=True) as tape:
        loss = LOSS(y, model(x, training=True))
    restricted = tape.gradient(loss, method.variables_to_train())
    full = tape.gradient(loss, model.trainable_variables)[own[0]:own[1]]
    equal = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(restricted, full))
    method.apply_gradients(restricted)
    method.finish()
    return {"own": [int(own[2]), int(own[3])], "total": int(total), "names": names, "restricted_equals_full": equal,
            "steps": method.steps}


def check_stale_momentum(topo):
    """PASSM+ back to ASSM: the momentum of the layers another process updated meanwhile is
    zeroed; this process's own layers keep theirs."""
    model = make_model(width=32, depth=3)
    opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    method = PASSMPlus([0, 2]).start(model, opt)
    x, y = digits.split()[0][:32], digits.split()[2][:32]

    def step():
        own = method.variables_to_train()
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        method.apply_gradients(tape.gradient(loss, own))

    def momenta():
        return [np.concatenate([np.ravel(s.numpy()) for s in slot_variables(opt, v)]) for v in method.variables]

    step()                                   # epoch 0: ASSM, every layer's momentum moves
    moved_in_assm = all(np.any(m != 0) for m in momenta())
    method.set_epoch(1)                      # PASSM: only this process's layers
    own = {id(v) for v in method.variables_to_train()}
    step()
    before = momenta()
    changed = method.set_epoch(2)            # ASSM again
    after = momenta()
    mine = [id(v) in own for v in method.variables]
    method.finish()
    return {"moved_in_assm": moved_in_assm, "changed": changed, "owns_some": any(mine) and not all(mine),
            "others_zeroed": all(not np.any(a) for a, m in zip(after, mine) if not m),
            "own_kept": all(np.array_equal(a, b) for a, b, m in zip(after, before, mine) if m),
            "own_nonzero": all(np.any(a) for a, m in zip(after, mine) if m)}


def check_checkpoint(topo, epochs=2):
    x_train, x_test, y_train, y_test = digits.split()
    shard = equal_shard(topo, len(x_train))
    model = make_model()
    model.compile(tf.keras.optimizers.SGD(0.05, momentum=0.9), LOSS)
    callback = SharedModelCallback(ASSM(average_every=10))
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "final.weights.h5")
        model.fit(x_train[shard], y_train[shard], batch_size=16, epochs=epochs, verbose=0, callbacks=[callback])
        model.save_weights(path)
        restored = make_model(seed=5)
        restored.load_weights(path)
    same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), restored.get_weights()))
    return {"final_spread": spread(model.get_weights(), "final"), "restored_equal": same,
            "segments_left": sorted(p for p in os.listdir("/dev/shm") if p.startswith(f"hvdx-async-{os.getpid()}-")),
            "train_step_restored": "train_step" not in vars(model)}


# -- staleness: updates of others between a read and an update (gimpel2010 eq. 5) -------------------
def check_staleness(topo, rounds=10):
    """The node's two processes take turns (node-local barriers between turns): in round r the
    fast one (local rank 0) adds 2 updates, then the slow one (local rank 1), which read the
    model before them, adds its own: staleness exactly 2 for each of the slow one's updates
    (the delay of gimpel2010 sec. 6.1, made deterministic)."""
    assert topo.local_size == 2, "a node of 2 processes"
    model = make_model(width=16)
    method = ASSM(average_every=10 ** 9).start(model, tf.keras.optimizers.SGD(0.01))
    x, _, y, _ = digits.split()

    def step(s):
        with tf.GradientTape() as tape:
            loss = LOSS(y[s * 8:(s + 1) * 8], model(x[s * 8:(s + 1) * 8], training=True))
        method.apply_gradients(tape.gradient(loss, method.variables_to_train()))   # then reads the model

    for r in range(rounds):    # node-local barriers: each turn's update and read-back are over before the next
        if topo.local_rank == 0:
            step(2 * r)
            step(2 * r + 1)
        hvdx.barrier(topo.local_set)
        if topo.local_rank == 1:
            step(r)            # read at version 3r; the fast one made 2 updates since
        hvdx.barrier(topo.local_set)
    method.finish()
    return {"slow": topo.local_rank == 1, "staleness": method.stats()["staleness"], "steps": method.steps,
            "rounds": rounds}


# -- reset(): the membership "changed" (the same ranks) in the middle of training ----------------------
def check_reset(topo, steps=6, batch=16):
    """ASSM in a custom loop (the nodes average every 4 steps), reset() on every rank (no
    collective: the segment is unmapped), start() again (collective: a new segment per node
    from rank 0's model), more steps, finish(): every rank holds the same model and the counts
    (steps, staleness) went on across the reset (hvdx.lifecycle)."""
    model = make_model(width=16)
    opt = tf.keras.optimizers.SGD(0.05)
    method = ASSM(average_every=4).start(model, opt)
    old = method.shared.name
    x, _, y, _ = digits.split()
    rng = np.random.default_rng(topo.rank)

    def train(n):
        for _ in range(n):
            pick = rng.choice(len(x), batch, replace=False)
            with tf.GradientTape() as tape:
                loss = LOSS(y[pick], model(x[pick], training=True))
            method.apply_gradients(tape.gradient(loss, method.variables_to_train()))
    train(steps)
    method.reset(hvdx.topology())
    method.start(model, opt)
    new = method.shared.name != old
    spread_after_start = spread(model.get_weights(), "reset.start")
    train(steps)
    method.finish()
    method.close()
    hvdx.barrier()
    return {"final_spread": spread(model.get_weights(), "reset.final"), "spread_after_start": spread_after_start,
            "new_segment": new, "steps": method.steps, "expected_steps": 2 * steps,
            "staleness_updates": method.stats()["staleness"]["updates"],
            "segments_left": sorted(p for p in os.listdir("/dev/shm") if p.startswith(f"hvdx-async-{os.getpid()}-"))}


CHECKS = {"no_lost_update": check_no_lost_update, "staleness": check_staleness, "partition": check_partition,
          "checkpoint": check_checkpoint, "convergence": check_convergence, "reset": check_reset,
          "stale_momentum": check_stale_momentum}
