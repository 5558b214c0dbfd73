"""DASO on every rank of an m x n job, claim by claim (coquelin2021, sec. 3).

Run by tests/test_daso.py through the suite (tests/multirank/suite.py): `CHECKS` below, each
returning what the test asserts on.
"""
import gc
import os
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdx
from hvdx.daso import DASO, DASOCallback
from tests.multirank import digits
from tests.multirank.rank import spread


def make_model(seed=0, width=32):
    return digits.mlp(seed, width)


LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batches(topo, steps, batch=16, seed=1):
    """This rank's own batches (different on every rank), the same in every run."""
    x_train, _, y_train, _ = digits.split()
    rng = np.random.default_rng(seed + 1000 * topo.rank)
    picks = [rng.choice(len(x_train), batch, replace=False) for _ in range(steps)]
    return [(tf.constant(x_train[p]), tf.constant(y_train[p])) for p in picks]


def daso_step(model, opt):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    return step


# -- 1. blocking, float32, every step == synchronous Horovod -----------------------------------
def check_blocking_equals_horovod(topo, steps=6):
    data = batches(topo, steps)
    horovod_model = make_model()
    sgd = tf.keras.optimizers.SGD(0.1, momentum=0.9)

    @tf.function
    def horovod_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, horovod_model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        sgd.apply_gradients(zip(tape.gradient(loss, horovod_model.trainable_variables),
                                horovod_model.trainable_variables))

    for x, y in data:
        horovod_step(x, y)
    expected = [v.numpy() for v in horovod_model.trainable_variables]
    out = {}
    transports = []  # each optimizer's, for the check that a dropped optimizer closes its own
    for wire in ("float32", "bfloat16", "float16"):
        initial = make_model().get_weights()  # every rank builds as many models: Keras names stay aligned
        model = make_model(seed=10 + topo.rank)  # other initial weights on every rank: DASO starts from rank 0's
        if topo.rank == 0:
            model.set_weights(initial)
        opt = DASO(tf.keras.optimizers.SGD(0.1, momentum=0.9), total_epochs=1, warmup_epochs=1, cooldown_epochs=0,
                   blocking_wire_dtype=wire)
        step = daso_step(model, opt)
        for x, y in data:
            step(x, y)
            opt.after_step()
        got = [v.numpy() for v in model.trainable_variables]
        momenta = [v.numpy() for v in opt.inner_optimizer.variables if v.shape.rank]  # the slots
        out[wire] = {
            "max_error": max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected)),
            "max_update": max(float(np.max(np.abs(a - b))) for a, b in zip(expected, make_model().get_weights())),
            "spread": spread(got, f"blocking.{wire}"),
            "momentum_spread": spread(momenta, f"momentum.{wire}"),
            "off_bf16_grid": int(sum(np.count_nonzero(w != w.astype("bfloat16").astype(np.float32)) for w in got)),
            "groups": [a.blocking_group for a in opt.history],
        }
        transports.append(opt._sync.transport)
        del model, opt, step  # a custom loop that never calls close(): collecting the optimizer closes it
        gc.collect()
        out[wire]["earlier_transports_open"] = sum(not t.closed for t in transports[:-1])
    out["transports_open_when_dropped"] = sum(not t.closed for t in transports)
    return out


# -- 2. eq. 1, the measured staleness, the rotation, the drains --------------------------------
def check_merge_formula(topo, max_global_skips=8, steps_per_epoch=(17, 13), lr=1.0):
    """One variable, SGD without momentum and rank-valued gradients, against a simulation of
    every rank in float64 driven by the actions DASO reports."""
    var = tf.Variable(np.full(5, 0.5, np.float32) * (topo.rank + 1))  # rank 0's value wins
    opt = DASO(tf.keras.optimizers.SGD(lr), total_epochs=len(steps_per_epoch), warmup_epochs=0, cooldown_epochs=0,
               max_global_skips=max_global_skips, blocking_wire_dtype="float32")

    @tf.function
    def step(g):
        opt.apply_gradients([(g, var)])

    def grad(rank, k):
        return -(rank + 1) * (k % 3 + 1) * np.arange(1, 6, dtype=np.float64) / 10.0

    nodes, P = topo.node_ranks, topo.num_nodes
    x = {r: np.full(5, 0.5) for r in range(topo.size)}
    snapshot = None
    errors, actions, drains, spreads = [], [], [], []

    def merge(group, S):
        if P == 1:
            return  # one node: nothing global to merge
        for node in nodes:
            member = node[group]
            value = (2 * S * x[member] + sum(snapshot)) / (2 * S + P)
            for r in node:
                x[r] = value.copy()

    k = 0
    for epoch, steps in enumerate(steps_per_epoch):
        for _ in range(steps):
            step(tf.constant(grad(topo.rank, k), tf.float32))
            for node in nodes:  # node-local gradient averaging, then the local update
                g = np.mean([grad(r, k) for r in node], axis=0)
                for r in node:
                    x[r] = x[r] - lr * g
            a = opt.after_step()
            if a.merge_group is not None:
                merge(a.merge_group, a.staleness)
                actions.append(("merge", a.step, a.merge_group, a.staleness))
            if a.start_group is not None:
                snapshot = [x[node[a.start_group]].copy() for node in nodes]
                actions.append(("start", a.step, a.start_group))
            errors.append(float(np.max(np.abs(var.numpy() - x[topo.rank]))))
            k += 1
        in_flight = opt.schedule.pending_group, opt.schedule.pending_step
        opt.end_epoch(1.0)
        if in_flight[0] is not None:
            merge(in_flight[0], k - in_flight[1])
            drains.append(("drain", k, in_flight[0], k - in_flight[1]))
        mean = np.mean([x[node[0]] for node in nodes], axis=0)
        for r in x:
            x[r] = mean.copy()
        errors.append(float(np.max(np.abs(var.numpy() - x[topo.rank]))))
        spreads.append(spread([var.numpy()], f"drain.{epoch}"))
    return {"max_error": max(errors), "scale": float(np.max(np.abs(x[0]))), "actions": actions,
            "drains": drains, "drain_spreads": spreads, "B": opt.schedule.B, "W": opt.schedule.W}


# -- 3. checkpoint / restore in the middle of a cycle ---------------------------------------
def check_checkpoint_mid_cycle(topo, before=9, after=11, epoch_steps=12):
    """Steps 1..`before` (an exchange in flight at the end), drain, save, then `after` more
    steps; a fresh model and optimizer restored from the checkpoint run the same `after`
    steps: same parameters, same schedule."""
    data = batches(topo, before + after, seed=7)
    directory = os.path.join(tempfile.gettempdir(), f"hvdx-daso-ckpt-{os.getppid()}-{topo.rank}")

    def new_run(seed):
        model = make_model(seed)
        opt = DASO(tf.keras.optimizers.SGD(0.05, momentum=0.9), total_epochs=4, warmup_epochs=0, cooldown_epochs=1,
                   max_global_skips=8)  # B = 8, W = 2: at step 9 an exchange is in flight
        return model, opt, daso_step(model, opt)

    def run_steps(opt, step, pieces, first_index):
        for i, (x, y) in enumerate(pieces, start=first_index):
            step(x, y)
            opt.after_step()
            if (i + 1) % epoch_steps == 0:
                opt.end_epoch(1.0 / (i + 1))

    model, opt, step = new_run(0)
    run_steps(opt, step, data[:before], 0)
    in_flight_before_drain = opt.schedule.in_flight
    phase_at_save = opt.schedule.phase
    opt.drain()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
    path = checkpoint.save(os.path.join(directory, "ckpt"))
    saved_state = opt.schedule.state()
    run_steps(opt, step, data[before:], before)
    expected = [v.numpy() for v in model.variables]
    expected_state = opt.schedule.state()

    model2, opt2, step2 = new_run(5)
    model2(data[0][0])  # build, so that the checkpoint restores the weights right away
    tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path).assert_existing_objects_matched()
    opt2._load_state_if_restored()
    restored_state = opt2.schedule.state()
    run_steps(opt2, step2, data[before:], before)
    got = [v.numpy() for v in model2.variables]
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
    return {"in_flight_before_drain": bool(in_flight_before_drain), "phase_at_save": phase_at_save,
            "state_restored": restored_state == saved_state, "state_continues": opt2.schedule.state() == expected_state,
            "max_difference": max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected)),
            "actions_after": [(a.step, a.merge_group, a.staleness, a.start_group, a.blocking_group)
                              for a in opt2.history]}


# -- 4. Model.fit on digits: DASO vs synchronous Horovod ----------------------------------------
def check_convergence(topo, epochs=16, batch=16):
    import horovod.tensorflow.keras as hvd_keras

    x_train, x_test, y_train, y_test = digits.split()
    per_rank = len(x_train) // topo.size
    x_mine, y_mine = x_train[topo.rank::topo.size][:per_rank], y_train[topo.rank::topo.size][:per_rank]
    out = {}
    for method in ("horovod", "daso"):
        model = make_model(seed=3, width=64)
        inner = tf.keras.optimizers.SGD(0.05, momentum=0.9)
        callbacks = []
        if method == "horovod":
            opt = hvd_keras.DistributedOptimizer(inner)
            callbacks.append(hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0))
        else:
            opt = DASO(inner, total_epochs=epochs, warmup_epochs=2, cooldown_epochs=2, max_global_skips=4,
                       plateau_patience=1, plateau_threshold=0.05)
            callbacks.append(DASOCallback())
        model.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
        tf.keras.utils.set_random_seed(4 + topo.rank)
        history = model.fit(x_mine, y_mine, batch_size=batch, epochs=epochs, verbose=0, callbacks=callbacks,
                            shuffle=True)
        accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
        out[method] = {"accuracy": accuracy, "loss": [float(v) for v in history.history["loss"]],
                       "spread": spread(model.get_weights(), f"fit.{method}")}
        if method == "daso":
            out[method]["events"] = list(opt.events)
            out[method]["starts"] = sum(a.start_group is not None for a in opt.history)
            out[method]["blocking"] = sum(a.blocking_group is not None for a in opt.history)
            out[method]["exchange_seconds"] = sorted(opt.stats.exchange) if opt.stats else []
            out[method]["transport_closed_after_fit"] = opt._sync.transport.closed
    return out


# -- 5. mixed precision, and the .keras format ----------------------------------------------------
def check_mixed_precision_and_keras_format(topo, steps=10):
    x_train, _, y_train, _ = digits.split()
    x, y = x_train[topo.rank::topo.size][:16 * steps], y_train[topo.rank::topo.size][:16 * steps]
    if topo.rank == 1:
        x = x.copy()
        x[3] = 1e30  # an overflowing batch on one rank: the loss scaler must skip it everywhere
    if topo.rank == 0:
        make_model(seed=99)  # Keras' layer names now differ between ranks: DASO must not pair collectives by them
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model(seed=2)
        opt = tf.keras.mixed_precision.LossScaleOptimizer(
            DASO(tf.keras.optimizers.SGD(0.05), total_epochs=3, warmup_epochs=1, cooldown_epochs=1,
                 max_global_skips=2))
        model.compile(optimizer=opt, loss=LOSS)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[DASOCallback()])
        first = opt.inner_optimizer._sync.transport  # closed at the fit's end; the next fit opens another
        model.fit(x, y, batch_size=16, initial_epoch=2, epochs=3, verbose=0, callbacks=[DASOCallback()])
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    weights = model.get_weights()
    daso = opt.inner_optimizer
    second = daso._sync.transport
    path = os.path.join(tempfile.gettempdir(), f"hvdx-daso-{os.getppid()}-{topo.rank}.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    os.remove(path)
    loaded_daso = loaded.optimizer.inner_optimizer if hasattr(loaded.optimizer, "inner_optimizer") else None
    return {"finite": bool(all(np.isfinite(w).all() for w in weights)), "spread": spread(weights, "mixed"),
            # the loss scale is node-local: only a node's ranks see each other's overflows
            "loss_scales": [float(s) for s in hvd.allgather(tf.reshape(opt.loss_scale, [1]), name="mixed.scale")],
            "loaded_type": type(loaded_daso).__name__,
            "transports": {"first_closed": first.closed, "second_closed": second.closed, "new": second is not first,
                           "epochs": daso.schedule.epoch},
            "state_round_trip": loaded_daso is not None and loaded_daso.schedule.state() == daso.schedule.state(),
            "weights_round_trip": all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), weights))}


# -- 6. bad arguments and ranks that disagree ---------------------------------------------------
def check_errors(topo):
    """The message of each misuse (ValueError / RuntimeError naming what to fix)."""
    import horovod.tensorflow.keras as hvd_keras

    from hvdx.agreement import RankMismatchError

    def message(fn, *exceptions):
        try:
            fn()
        except exceptions as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    sgd = tf.keras.optimizers.SGD
    out = {
        "total_epochs": message(lambda: DASO(sgd(0.1), total_epochs=0), ValueError),
        "phases": message(lambda: DASO(sgd(0.1), total_epochs=3, warmup_epochs=2, cooldown_epochs=2), ValueError),
        "skips": message(lambda: DASO(sgd(0.1), total_epochs=3, max_global_skips=0), ValueError),
        "wire": message(lambda: DASO(sgd(0.1), total_epochs=3, blocking_wire_dtype="int8"), ValueError),
        "optimizer": message(lambda: DASO("sgd", total_epochs=3), ValueError),
        "timeout": message(lambda: DASO(sgd(0.1), total_epochs=3, timeout=0), ValueError),
        "horovod_keras": message(lambda: DASO(hvd_keras.DistributedOptimizer(sgd(0.1)), total_epochs=3), ValueError),
        "horovod_tf": message(lambda: DASO(hvd.DistributedOptimizer(sgd(0.1)), total_epochs=3), ValueError),
        "hvdx": message(lambda: DASO(hvdx.DistributedOptimizer(sgd(0.1)), total_epochs=3), ValueError),
    }
    opt = DASO(sgd(0.1), total_epochs=2)
    out["after_step_first"] = message(opt.after_step, RuntimeError)
    model = make_model()
    model.compile(optimizer=sgd(0.1), loss=LOSS)
    out["callback_without_daso"] = message(
        lambda: model.fit(np.zeros((4, 64), np.float32), np.zeros(4), epochs=1, verbose=0,
                          callbacks=[DASOCallback()]), ValueError)
    model = make_model()
    model.compile(optimizer=DASO(sgd(0.1), total_epochs=2), loss=LOSS, steps_per_execution=2)
    out["steps_per_execution"] = message(
        lambda: model.fit(np.zeros((4, 64), np.float32), np.zeros(4), epochs=1, verbose=0,
                          callbacks=[DASOCallback()]), ValueError)
    # Model.fit without DASOCallback: no global synchronisation would ever run; the second step fails
    model = make_model()
    model.compile(optimizer=DASO(sgd(0.1), total_epochs=2), loss=LOSS)
    out["fit_without_callback"] = message(
        lambda: model.fit(np.zeros((48, 64), np.float32), np.zeros(48), batch_size=16, epochs=1, verbose=0),
        tf.errors.InvalidArgumentError)
    # ranks that disagree on the schedule fail on every rank, before any global average
    model = make_model()
    opt = DASO(sgd(0.1), total_epochs=4, max_global_skips=4 + (topo.rank == topo.size - 1))
    step = daso_step(model, opt)
    x, y = batches(topo, 1)[0]
    step(x, y)
    out["disagree"] = message(opt.after_step, RankMismatchError)
    return out


# -- 7. a checkpoint restored onto another topology ------------------------------------------
def check_restore_other_topology(topo, steps=4):
    """A drained checkpoint whose schedule was planned for another number of ranks per node (as a
    2x2 run saves it when restored on 2x1, a 2x1 run's on 2x2: the state of this run with the other
    group count) restores here, re-plans its groups, and trains through starts, merges and
    blocking averages; the Keras config path (from_config) re-plans too, and a state saved with
    an exchange in flight is refused when it is restored onto another topology."""
    import shutil

    from hvdx.daso.schedule import Schedule

    saved_groups = 2 if topo.local_size == 1 else 1
    data = batches(topo, 2 + steps, seed=11)
    directory = os.path.join(tempfile.gettempdir(), f"hvdx-daso-topology-{os.getppid()}-{topo.rank}")

    def new_run(seed):
        model = make_model(seed)
        opt = DASO(tf.keras.optimizers.SGD(0.05, momentum=0.9), total_epochs=3, warmup_epochs=0, cooldown_epochs=1,
                   max_global_skips=2)  # epochs 0 and 1 cycle: B = 2, W = 1
        return model, opt, daso_step(model, opt)

    model, opt, step = new_run(0)
    for x, y in data[:2]:  # the first epoch: one exchange, drained at its end
        step(x, y)
        opt.after_step()
    opt.end_epoch(1.0)
    # the schedule exactly as the other topology saves it: the same state, its group count
    opt.schedule = Schedule.from_state({**opt.schedule.state(), "num_groups": saved_groups})
    opt._write_state()
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(directory, "ckpt"))

    model2, opt2, step2 = new_run(5)
    model2(data[0][0])  # build, so that the checkpoint restores the weights right away
    tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path).assert_existing_objects_matched()
    for x, y in data[2:]:  # the second cycling epoch: starts and merges
        step2(x, y)
        opt2.after_step()
    opt2.end_epoch(0.9)
    x, y = data[0]  # the cool-down epoch: a blocking average
    step2(x, y)
    opt2.after_step()
    opt2.end_epoch(0.8)
    shutil.rmtree(directory, ignore_errors=True)  # the optimizer's slots were restored at its first step
    groups = sorted({g for a in opt2.history for g in (a.merge_group, a.start_group, a.blocking_group)
                     if g is not None})

    config = opt.get_config()  # the .keras format's path: the schedule comes with the config
    from_config = DASO.from_config(config)
    in_flight = dict(config, schedule_state={**config["schedule_state"], "pending_group": 0, "pending_step": 3})
    try:
        DASO.from_config(in_flight)
        refused = "no error"
    except ValueError as exc:
        refused = f"ValueError: {exc}"
    return {"saved_groups": saved_groups, "groups_after": opt2.schedule.num_groups, "groups_used": groups,
            "syncs": opt2.schedule.syncs, "starts": sum(a.start_group is not None for a in opt2.history),
            "merges": sum(a.merge_group is not None for a in opt2.history),
            "spread": spread([v.numpy() for v in model2.trainable_variables], "topology.spread"),
            "from_config_groups": from_config.schedule.num_groups, "in_flight_refused": refused}


# -- 8. reset(): the membership "changed" (the same ranks) in the middle of a cycle --------------
def check_reset(topo, before=4, after=5, cooldown=2):
    """Cycling (B = 2, W = 1): at step 4 an exchange is in flight; reset() on every rank drops it
    and the transport without a collective, start() takes rank 0's parameters and opens a new
    transport; training goes on through merges and the cool-down's blocking averages and
    finish() leaves every rank with the same parameters (hvdx.lifecycle)."""
    data = batches(topo, before + after + cooldown, seed=13)
    model = make_model(seed=20 + topo.rank)  # other parameters on every rank: the first trace takes rank 0's
    opt = DASO(tf.keras.optimizers.SGD(0.05, momentum=0.9), total_epochs=2, warmup_epochs=0, cooldown_epochs=1,
               max_global_skips=2)
    step = daso_step(model, opt)
    for x, y in data[:before]:
        step(x, y)
        opt.after_step()
    in_flight, old = opt.schedule.in_flight, opt._sync.transport
    opt.reset(hvdx.topology())  # no collective: each rank on its own
    pending = opt.schedule.pending_group
    old_closed = old.closed
    opt.start(model)            # collective
    new = opt._sync.transport is not old and not opt._sync.transport.closed
    spread_after_start = spread([v.numpy() for v in model.trainable_variables], "reset.start")
    mark = len(opt.history)
    for x, y in data[before:before + after]:
        step(x, y)
        opt.after_step()
    opt.end_epoch(1.0)
    for x, y in data[before + after:]:
        step(x, y)
        opt.after_step()
    opt.end_epoch(0.9)
    opt.finish()
    opt.close()
    opt.close()
    later = list(opt.history)[mark:]
    return {"in_flight_at_reset": bool(in_flight), "pending_after_reset": pending, "old_transport_closed": old_closed,
            "new_transport": new, "groups": opt.schedule.num_groups, "steps": opt.schedule.step,
            "expected_steps": before + after + cooldown,
            "merges_after_reset": sum(a.merge_group is not None for a in later),
            "blocking_after_reset": sum(a.blocking_group is not None for a in later),
            "spread_after_start": spread_after_start,
            "final_spread": spread([v.numpy() for v in model.trainable_variables], "reset.final"),
            "closed_twice": opt._sync.transport.closed}


CHECKS = {"blocking": check_blocking_equals_horovod, "merge": check_merge_formula,
          "checkpoint": check_checkpoint_mid_cycle, "convergence": check_convergence,
          "mixed": check_mixed_precision_and_keras_format, "errors": check_errors,
          "restore_other_topology": check_restore_other_topology, "reset": check_reset}

