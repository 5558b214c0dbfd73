"""A rank script for the progress watchdog (tests/test_watchdog.py): one scenario per launch.

Scenarios (the first argument):
- extra-step <communication>: a custom loop with hvdx.DistributedGradientTape; rank
  $STALL_RANK runs one more step than the others, then every rank meets at a barrier;
- direct-extra: a strategy called directly, one call more on rank $STALL_RANK;
- extra-exit <communication>: as extra-step, but the ranks exit without the barrier;
- sleep: rank $STALL_RANK stops issuing collectives after two steps and sleeps, alive;
- daso-sleep: DASO's blocking global synchronisation every step (its warm-up); rank
  $STALL_RANK sleeps after two steps, alive;
- straggler: rank $STALL_RANK is 15x slower than the others per step; every rank runs to the end;
- timeline: every rank runs the tape's steps, then DASO's, to the end (under $HOROVOD_TIMELINE:
  hvdx's spans in Horovod's timeline, tests/test_timeline.py).

$STALL_EAGER=1 runs the tape's steps eagerly instead of in a tf.function. Every rank prints "step <n> done" per step and "finished" at the end; the watchdog's bound
comes from $HVDX_STALL_TIMEOUT_SECONDS (set by the test).
"""
import os
import sys
import time

import hvdx
import tensorflow as tf

STEPS = int(os.environ.get("STALL_STEPS", "3"))
STALL_RANK = int(os.environ.get("STALL_RANK", "1"))


def model_and_step(communication: str):
    """A linear model and a step over hvdx's tape (a tf.function unless $STALL_EAGER)."""
    tf.random.set_seed(0)
    w = tf.Variable(tf.random.normal([16, 4]), name="w")
    b = tf.Variable(tf.zeros([4]), name="b")
    options = {"density": 0.25} if communication == "hitopk" else {}

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b))
        tape = hvdx.DistributedGradientTape(tape, communication=communication, **options)
        grads = tape.gradient(loss, [w, b])
        w.assign_sub(0.01 * grads[0])
        b.assign_sub(0.01 * grads[1])
        return loss

    return step if os.environ.get("STALL_EAGER") else tf.function(step)


def daso_steps(topo, sleeper: int = STALL_RANK) -> None:
    """DASO in a custom loop, warm-up only (a blocking global synchronisation every step);
    rank `sleeper` sleeps after two steps."""
    tf.random.set_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(4)])
    opt = hvdx.DASO(tf.keras.optimizers.SGD(0.01), total_epochs=1, warmup_epochs=1, cooldown_epochs=0)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    x = tf.random.normal([8, 16], seed=topo.rank)
    for n in range(STEPS + 2):
        if topo.rank == sleeper and n == 2:
            print(f"rank {topo.rank} sleeps", flush=True)
            time.sleep(3600)
        step(x)
        opt.after_step()
        print(f"rank {topo.rank} step {n + 1} done", flush=True)


def main() -> None:
    scenario = sys.argv[1]
    topo = hvdx.init()
    if scenario == "daso-sleep":
        daso_steps(topo)
        return
    x = tf.random.normal([8, 16], seed=topo.rank)
    if scenario == "direct-extra":
        strategy = hvdx.comm.get("hitopk", density=0.25)
        buffer = tf.Variable(tf.random.normal([64], seed=topo.rank))
        call = tf.function(lambda: strategy(buffer.read_value(), "direct"))
        steps = STEPS + (topo.rank == STALL_RANK)
    else:
        call = (lambda s=model_and_step(sys.argv[2] if len(sys.argv) > 2 else "hitopk"): s(x))
        steps = STEPS + (scenario in ("extra-step", "extra-exit") and topo.rank == STALL_RANK)
    if scenario == "straggler":
        steps = int(os.environ.get("STALL_STEPS", "12"))
    for n in range(steps):
        if scenario == "sleep" and topo.rank == STALL_RANK and n == 2:
            print(f"rank {topo.rank} sleeps", flush=True)
            time.sleep(3600)
        if scenario == "straggler":
            time.sleep(float(os.environ.get("STRAGGLER_STEP", "0.4")) * (15 if topo.rank == STALL_RANK else 1))
        call()
        print(f"rank {topo.rank} step {n + 1} done", flush=True)
    if scenario == "timeline":
        daso_steps(topo, sleeper=-1)
    if scenario != "extra-exit":
        hvdx.barrier()
    print(f"rank {topo.rank} finished", flush=True)


if __name__ == "__main__":
    main()
