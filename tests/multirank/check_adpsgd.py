"""AD-PSGD on every rank of an m x n Horovod job, claim by claim (lian2018 Algorithm 1, sec.
3). Run by tests/test_adpsgd.py through the suite (tests/multirank/suite.py): `CHECKS`
below, each returning what the test asserts on. Every check ends in a collective (the final
average), every rank issues the same collectives in the same order.
"""
import os
import tempfile
import time

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import hvdx
from hvdx.adpsgd import ADPSGD, ADPSGDCallback
from hvdx.zoo import mlp
from tests.multirank import digits
from tests.multirank.rank import spread


def settle(adp, tag):
    """Waits until this rank starts no exchange, then meets every rank: none is in flight."""
    deadline = time.monotonic() + 60
    while not adp.gossip.idle():
        assert time.monotonic() < deadline, "exchanges still in flight after 60 s"
        time.sleep(0.01)
    hvdx.barrier()


make_model = digits.mlp


LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# -- consensus: zero gradients, the mean is kept and reached ----------------------------------------
def check_consensus(topo, steps=300):
    model = make_model()
    adp = ADPSGD(model.trainable_variables, topology="exponential", timeout=60).start()
    rng = np.random.default_rng(topo.rank)
    # the variables hold start()'s average on every rank until this rank's step() (the gossip
    # model may already be moving: other ranks' first exchanges can precede this line)
    before = adp._flat().astype(np.float64)
    for v in model.trainable_variables:  # a different model on every rank: an update of this rank
        v.assign_add(rng.normal(size=v.shape).astype(np.float32))
    perturbation = adp._flat().astype(np.float64) - before  # this rank's update (read before step():
    adp.step()                                                # an exchange may follow it at once)
    spread_before = spread([perturbation], "before")
    expected = before + hvd.allreduce(tf.constant(perturbation), op=hvd.Average, name="adpsgd.expected").numpy()
    for _ in range(steps):
        adp.step()  # zero gradient: only the averaging moves the model
        time.sleep(0.003)
    settle(adp, "consensus")
    now = adp.gossip.model()  # no exchange in flight anywhere: a consistent snapshot
    mean_now = hvd.allreduce(tf.constant(now, tf.float64), op=hvd.Average, name="adpsgd.mean").numpy()
    mean_error = float(np.abs(mean_now - expected).max())
    spread_after = spread([now], "after")
    stats = adp.stats()
    adp.finish()
    return {"mean_error": mean_error, "spread_before": spread_before, "spread_after": spread_after,
            "final_spread": spread([v.numpy() for v in model.trainable_variables], "final"), "stats": stats}


# -- thousands of exchanges: none lost, none stuck -------------------------------------------------
def check_exchanges(topo, steps=2500):
    var = tf.Variable(tf.zeros(1000))
    adp = ADPSGD([var], topology="exponential", timeout=60).start()
    rng = np.random.default_rng(100 + topo.rank)
    applied = np.zeros(1000)
    for k in range(steps):
        update = (rng.normal(size=1000) * 1e-3).astype(np.float32)
        applied += update
        var.assign_add(update)  # what an optimizer does to the local, possibly stale, copy
        adp.step()
        if k % 2 == 0:
            time.sleep(0.001)
    adp.finish()
    stats = adp.stats()  # after the final average: no exchange in flight anywhere, counts complete
    expected = hvd.allreduce(tf.constant(applied), op=hvd.Average, name="adpsgd.applied").numpy()
    return {"active": stats["active"], "exchanges": stats["exchanges"], "steps": stats["steps"],
            "partners": stats["partners"], "lost": float(np.abs(var.numpy() - expected).max())}


# -- one rank slowed by a sleep per step -----------------------------------------------------------
class Sleep(tf.keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def check_slow_rank(topo, seconds=8.0):
    """The last rank sleeps 0.2 s per step; every rank trains `seconds` of its own wall clock."""
    x_train, _, y_train, _ = digits.split()
    model = make_model(width=16)
    model.compile(tf.keras.optimizers.SGD(0.05), LOSS)
    # trace the training step first: on loaded cores tracing alone can take the whole budget
    model.fit(x_train[:16], y_train[:16], batch_size=16, epochs=1, verbose=0)
    gossip = ADPSGDCallback(topology="ring", max_seconds=seconds, timeout=60)
    slow = topo.rank == topo.size - 1
    callbacks = [gossip] + ([Sleep(0.2)] if slow else [Sleep(0.002)])
    model.fit(x_train[topo.rank::topo.size], y_train[topo.rank::topo.size], batch_size=16, epochs=10000,
              verbose=0, callbacks=callbacks)
    return {"steps": gossip.stats["steps"], "exchanges": gossip.stats["exchanges"], "slow": slow,
            "spread": spread(model.get_weights(), "slow")}


# -- an epoch counted over all ranks: the fast ranks do the slow rank's share ---------------------------
def check_global_budget(topo, global_epochs=64, seconds=0.1, fast=0.002):
    """The last rank sleeps `seconds` per step, the others `fast`; fit stops when all ranks
    together ran `global_epochs` epochs of steps (ADPSGDCallback(global_epochs=...)). The
    budget is several seconds of training: on a loaded machine a rank process can go a second
    without CPU (runnable, not scheduled), which a one-second run cannot absorb."""
    x_train, _, y_train, _ = digits.split()
    shard = equal_shard(topo, len(x_train))
    model = make_model(width=16)
    model.compile(tf.keras.optimizers.SGD(0.05), LOSS)
    model.fit(x_train[:16], y_train[:16], batch_size=16, epochs=1, verbose=0)  # trace first (see check_slow_rank)
    gossip = ADPSGDCallback(topology="ring", global_epochs=global_epochs, timeout=60)
    slow = topo.rank == topo.size - 1
    history = model.fit(x_train[shard], y_train[shard], batch_size=16, epochs=global_epochs * topo.size, verbose=0,
                        callbacks=[gossip, Sleep(seconds if slow else fast)])
    return {"steps": gossip.stats["steps"], "budget": gossip.stats["step_budget"], "slow": slow,
            "known_steps": gossip.stats["known_steps"],
            "exchanges": gossip.stats["exchanges"], "epochs_run": len(history.history.get("loss", [])),
            "steps_per_epoch": -(-len(x_train[shard]) // 16), "spread": spread(model.get_weights(), "budget")}


# -- convergence on digits: AD-PSGD against AllReduce-SGD at equal epochs ----------------------------
def equal_shard(topo, n):
    """This rank's shard, the same size on every rank (AllReduce-SGD needs equal step counts)."""
    return slice(topo.rank, n - n % topo.size, topo.size)


def check_convergence(topo, epochs=20, batch=16, lr=0.1):
    x_train, x_test, y_train, y_test = digits.split()
    shard = equal_shard(topo, len(x_train))
    results = {}
    for method in ("allreduce", "adpsgd"):
        model = make_model()
        if method == "allreduce":
            opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(lr))
            callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)]
        else:
            opt = tf.keras.optimizers.SGD(lr)
            callbacks = [ADPSGDCallback(topology="exponential", timeout=60)]
        model.compile(opt, LOSS, metrics=["accuracy"])
        tf.keras.utils.set_random_seed(1 + topo.rank)
        model.fit(x_train[shard], y_train[shard], batch_size=batch, epochs=epochs, verbose=0, callbacks=callbacks)
        results[method] = float(model.evaluate(x_test, y_test, verbose=0)[1])
        results[f"{method}_spread"] = spread(model.get_weights(), method)
    return results


# -- checkpoint and restore mid-training --------------------------------------------------------------
class SaveAndMeasure(tf.keras.callbacks.Callback):
    """After ADPSGDCallback's average at each epoch end: saves the weights, measures the spread."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory
        self.spreads = []

    def on_epoch_end(self, epoch, logs=None):
        self.model.save_weights(os.path.join(self.directory, f"epoch{epoch}.weights.h5"))
        self.spreads.append(spread(self.model.get_weights(), f"saved.{epoch}"))


def check_checkpoint(topo, epochs=2):
    x_train, x_test, y_train, y_test = digits.split()
    shard = slice(topo.rank, None, topo.size)
    with tempfile.TemporaryDirectory() as directory:
        model = make_model()
        model.compile(tf.keras.optimizers.SGD(0.05), LOSS)
        saver = SaveAndMeasure(directory)
        model.fit(x_train[shard], y_train[shard], batch_size=16, epochs=epochs, verbose=0,
                  callbacks=[ADPSGDCallback(topology="ring", average_every_epoch=True, timeout=60), saver])
        saved = mlp(64, (64,))  # make_model's, unseeded: its weights come from the file
        saved.load_weights(os.path.join(directory, "epoch0.weights.h5"))  # restore mid-training
    restored = saved.get_weights()
    restored_spread = spread(restored, "restored")
    saved.compile(tf.keras.optimizers.SGD(0.05), LOSS)
    loss_before = float(saved.evaluate(x_test, y_test, verbose=0))
    saved.fit(x_train[shard], y_train[shard], batch_size=16, epochs=epochs, verbose=0,
              callbacks=[ADPSGDCallback(topology="ring", timeout=60)])
    return {"saved_spread": max(saver.spreads), "restored_equal": restored_spread == 0.0,
            "final_spread": spread(saved.get_weights(), "final"), "loss_before": loss_before,
            "loss_after": float(saved.evaluate(x_test, y_test, verbose=0))}


# -- bad arguments ----------------------------------------------------------------------------------
def check_errors(topo):
    out = {}
    model = make_model(width=8)
    model.compile(hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), LOSS)
    try:
        model.fit(np.zeros((4, 64), np.float32), np.zeros(4), epochs=1, verbose=0, callbacks=[ADPSGDCallback()])
    except ValueError as exc:
        out["hvdx_optimizer"] = str(exc)
    try:
        ADPSGD(model.trainable_variables, topology="hypercube")
    except ValueError as exc:
        out["topology"] = str(exc)
    try:
        ADPSGD([tf.Variable(np.int32(3), name="count")])
    except ValueError as exc:
        out["non_float"] = str(exc)
    try:
        ADPSGD(model.trainable_variables, cross_node_weight=0)
    except ValueError as exc:
        out["cross_node_weight"] = str(exc)
    # hvdx's nodes decide the neighbour weights (no transport is started: no collective)
    weighted = ADPSGD(model.trainable_variables, cross_node_weight=0.25)
    out["weights"] = {str(p): w for p, w in (weighted.weights or {}).items()}
    out["neighbours"] = list(weighted.graph.neighbours(topo.rank))
    out["node_ranks"] = [list(r) for r in topo.node_ranks]
    hvdx.barrier()
    return out


# -- reset(): the membership "changed" (the same ranks) while the gossip runs -----------------------
def check_reset(topo, steps=20):
    """Gossip with random updates, one average(), reset() on every rank (no collective: the
    gossip and its transports end), start() again (collective: new neighbours' connections,
    every rank from the average), more steps, finish(): every rank holds the same model and the
    counts went on: the restarted gossip's step budget is what the ranks had not yet run
    (hvdx.lifecycle)."""
    model = make_model(width=16)
    adp = ADPSGD(topology="ring", timeout=60, step_budget=10_000).start(model)  # the model's float weights
    rng = np.random.default_rng(300 + topo.rank)

    def run(n):
        for _ in range(n):
            for v in model.trainable_variables:
                v.assign_add((rng.normal(size=v.shape) * 1e-3).astype(np.float32))
            adp.after_step()
            time.sleep(0.001)
    run(steps)
    adp.average()
    run(steps // 2)
    adp.reset(hvdx.topology())
    adp.start(model)
    budget_after_reset = adp.step_budget
    spread_after_start = spread(model.get_weights(), "reset.start")
    run(steps)
    adp.finish()
    adp.close()
    adp.close()
    state = adp.state()
    restored = ADPSGD(topology="ring")
    restored.restore(state)
    return {"final_spread": spread(model.get_weights(), "reset.final"), "spread_after_start": spread_after_start,
            "state": state, "steps_run": 2 * steps + steps // 2, "restored": restored.state(),
            "budget_after_reset": budget_after_reset, "budget_left": 10_000 - topo.size * (steps + steps // 2),
            "closed_twice": adp.gossip._closed}


def check_join(topo, steps=20):
    """Elastic Horovod adds a process: with a step budget, the ranks gossip, then the last rank
    starts over as a new process would (a new ADPSGD, no counts, no reset) while the others
    reset(); start() is collective over both kinds: every rank takes the same budget, the
    run's less the steps the ranks ran, the new one's predecessor's as last heard."""
    model = make_model(width=8)
    adp = ADPSGD(topology="ring", timeout=60, step_budget=10_000).start(model)
    rng = np.random.default_rng(400 + topo.rank)
    for _ in range(steps):
        for v in model.trainable_variables:
            v.assign_add((rng.normal(size=v.shape) * 1e-3).astype(np.float32))
        adp.after_step()
        time.sleep(0.001)
    adp.average()  # every rank's count heard by its neighbours (lagging only by the exchanges in flight)
    joined = topo.rank == topo.size - 1
    if joined:
        adp.close()
        adp = ADPSGD(topology="ring", timeout=60, step_budget=10_000)
    else:
        adp.reset(hvdx.topology())
    adp.start(model)
    budget = adp.step_budget
    adp.finish()
    adp.close()
    return {"budget": budget, "joined": joined, "budget_left": 10_000 - topo.size * steps, "steps": steps,
            "budgets": [int(b) for b in hvd.allgather_object(budget, name="adpsgd.join.budgets")]}


def check_callback_join(topo, global_epochs=2):
    """ADPSGDCallback(global_epochs) in an elastic job: a first fit ends after one epoch of the
    budget's two; a membership change then resets the ranks' ADPSGD (as hvdx.elastic's reset
    does) while the last rank starts over as an added process would (a new callback, its
    first fit). The next fit names its collectives alike on every rank and gives every rank
    one budget: what the first fit left of the run's."""
    import warnings

    x_train, _, y_train, _ = digits.split()
    shard = equal_shard(topo, len(x_train))
    model = make_model(width=8)
    model.compile(tf.keras.optimizers.SGD(0.05), LOSS)
    gossip = ADPSGDCallback(topology="ring", global_epochs=global_epochs, timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "fit's epochs ended before the ranks' steps reached global_epochs"
        model.fit(x_train[shard], y_train[shard], batch_size=16, epochs=1, verbose=0, callbacks=[gossip])
    first = gossip.stats
    joined = topo.rank == topo.size - 1
    if joined:
        gossip = ADPSGDCallback(topology="ring", global_epochs=global_epochs, timeout=60)
    else:
        gossip.adpsgd.reset(hvdx.topology())
    model.fit(x_train[shard], y_train[shard], batch_size=16, epochs=global_epochs * topo.size, verbose=0,
              callbacks=[gossip])
    return {"joined": joined, "first_budget": first["step_budget"],
            "ran": sum(hvd.allgather_object(first["steps"], name="adpsgd.callback_join.ran")),
            "budget": gossip.stats["step_budget"],
            "names": hvd.allgather_object(gossip.adpsgd.name, name="adpsgd.callback_join.names"),
            "spread": spread(model.get_weights(), "callback_join")}


CHECKS = {"consensus": check_consensus, "exchanges": check_exchanges, "slow_rank": check_slow_rank,
          "global_budget": check_global_budget,
          "convergence": check_convergence, "checkpoint": check_checkpoint, "errors": check_errors,
          "reset": check_reset, "join": check_join, "callback_join": check_callback_join}
