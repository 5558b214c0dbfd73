"""The DAWNBench ResNet-50 recipe of shi2021 (secs. 5.5-5.6, Tables 4-5): hvdx's parts composed
the way the paper's training job composes them. Progressive resizing (phases of epochs x
resolution @ local batch, `hvdx.phases`); MSTopK-SGD with HiTopKComm in the low-resolution
epochs, then 2DTAR; LARS with its norms by the parallel tensor operator, no decay on batch
norm and bias; warm-up and decay; label smoothing; mixed precision where a GPU is; DataCache
input with seeded random-resized crops (`hvdx.data.augment`, `hvdx.data.batches`); a
checkpoint every epoch and `--resume`; top-1 / top-5, time to target, throughput and scaling
efficiency per phase (`hvdx.throughput`), a summary and the curves.

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/dawnbench.py --preset demo
    horovodrun -np 128 -H node1:8,...,node16:8 python examples/dawnbench.py --preset imagenet \
        --data /nfs/imagenet/train --val-data /nfs/imagenet/val
    python examples/dawnbench.py --preset imagenet --dry-run      # the plan, as JSON

Any preset value can be overridden (`--phases 2x64@32,1x96@16 --switch-epoch 2 --lr 4`).
docs/dawnbench.md explains the recipe and how it maps to the paper. Written for tf.keras as
TensorFlow makes it: Keras 3 from TensorFlow 2.16 on, Keras 2 with TF_USE_LEGACY_KERAS=1 (or
TensorFlow 2.15); every part follows the model's Keras.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import hvdx
import numpy as np
import tensorflow as tf

from hvdx import checkpoints, phases as ph, throughput, zoo
from hvdx.data import augment, batches, demo
from hvdx.callbacks import CheckpointCallback, EpochLog
from hvdx.history import first_reaching, plot_curves
from hvdx.optimizers import LARS


@dataclass
class Config:
    """Everything a run depends on; a preset fills it, flags override it."""

    phases: List[ph.Phase]
    switch_epoch: int                 # HiTopK before this epoch, 2DTAR (hierarchical) from it on
    lr: float                         # peak learning rate of the first phase's global batch
    warmup_epochs: float
    decay_power: float = 2.0          # lr(e) = peak ((T - e) / (T - W))^power after warm-up
    momentum: float = 0.9
    weight_decay: float = 5e-5
    eeta: float = 0.001               # LARS' trust coefficient (eq. 11's gamma)
    max_trust_ratio: Optional[float] = None
    label_smoothing: float = 0.1
    density: float = 0.01             # HiTopK's k / d
    model: str = "resnet50"           # resnet50 | small
    widths: Tuple[int, ...] = (16, 32, 64)
    num_classes: int = 1000
    target: Tuple[str, float] = ("val_top5", 0.93)
    augment: str = "flip"             # one of hvdx.data.augment.KINDS
    crop_area: float = 0.08           # rrc: smallest crop, as a fraction of the cached image's area
    crop_source: float = 1.25         # rrc: DataCache keeps each phase's samples at this x its resolution
    mixed_precision: str = "auto"     # auto (on with a GPU) | on | off
    synthetic: bool = False
    synthetic_steps: int = 4          # synthetic: steps per epoch and validation steps
    data: Optional[str] = None        # a class-folder tree, or a TFRecord glob with --tfrecords
    val_data: Optional[str] = None
    tfrecords: bool = False
    demo_data: bool = False           # write the demo's digits JPEG folders (once) and train on them
    out: Optional[str] = None         # default ~/.cache/hvdx/dawnbench/<preset>
    keep_checkpoints: int = 3         # per rank, the newest; 0: all
    seed: int = 0
    resume: bool = False
    stop_after: Optional[int] = None  # stop after this many epochs in total (a pre-emption)
    verbose: int = 2
    deterministic: bool = False
    plot: bool = True
    comm_timing: bool = True
    se_steps: int = 0                 # > 0: time this many steps of each phase on each rank alone (SE)
    baseline_json: Optional[str] = None  # or: a 1-rank run's summary.json gives the 1-rank throughput
    elastic: bool = False             # Elastic Horovod: a preempted or added node resets the job, no restart

    def source_resolution(self, phase: ph.Phase) -> int:
        return augment.source_resolution(phase.resolution, self.augment, self.crop_source)

    def communication_at(self, epoch: int) -> str:
        return "hitopk" if epoch < self.switch_epoch else "hierarchical"


PRESETS = {
    # shi2021 sec. 5.6 / Table 4: 28 epochs, HiTopK for the 13 epochs at 96 px, then 2DTAR. The
    # paper gives neither the learning rate nor the warm-up: these are in the range published LARS
    # recipes use for a 32K batch (128 ranks x 256), neither tuned nor run at that scale here.
    "imagenet": dict(phases="13x96@256,11x128@256,3x224@256,1x288@128", switch_epoch=13, lr=29.0,
                     warmup_epochs=2.0, weight_decay=5e-5, model="resnet50", num_classes=1000,
                     target=("val_top5", 0.93), augment="rrc", crop_area=0.08, crop_source=1.25, density=0.01,
                     se_steps=20),
    # `make demo`: a small ResNet on upscaled, augmented scikit-learn digits written as JPEG class
    # folders; HiTopK then 2DTAR; random-resized crop of at least half the image, no mirror
    # (digits are not symmetric). Reaches val top-1 >= 0.9 (the stated target).
    "demo": dict(phases="3x24@32,2x32@32,1x40@16", switch_epoch=3, lr=8.0, warmup_epochs=1.0, model="small",
                 num_classes=10, target=("val_top1", 0.90), augment="rrc-noflip", crop_area=0.5, density=0.05,
                 eeta=0.01, max_trust_ratio=1.0, demo_data=True, se_steps=5),
    # the tests' smoke run: tiny model, 2 short phases, synthetic data
    "smoke": dict(phases="2x8@4,1x12@2", switch_epoch=2, lr=1.0, warmup_epochs=0.5, model="small", widths=(4, 8),
                  num_classes=4, target=("val_top1", 0.5), synthetic=True, synthetic_steps=3, density=0.1,
                  eeta=0.01, max_trust_ratio=1.0),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    p.add_argument("--phases", help="EPOCHSxRESOLUTION@BATCH,... (batch per rank)")
    p.add_argument("--switch-epoch", type=int, help="epoch (0-based) from which 2DTAR replaces HiTopK")
    for name in ("lr", "warmup-epochs", "decay-power", "momentum", "weight-decay", "eeta", "label-smoothing",
                 "density", "max-trust-ratio"):
        p.add_argument(f"--{name}", type=float)
    p.add_argument("--model", choices=["resnet50", "small"])
    p.add_argument("--num-classes", type=int)
    p.add_argument("--augment", choices=augment.KINDS,
                   help="flip: pad-and-crop + mirror; shift: pad-and-crop; rrc: random-resized crop + mirror")
    p.add_argument("--crop-area", type=float, help="rrc: smallest crop area, a fraction of the image's")
    p.add_argument("--crop-source", type=float, help="rrc: DataCache keeps samples at this x the resolution (>= 1)")
    p.add_argument("--se-steps", type=int, help="after training, time this many steps of each phase on every "
                                                "rank alone: the 1-rank throughput of SE (Table 4)")
    p.add_argument("--baseline-json", help="a 1-rank run's summary.json: its samples/s are SE's 1-rank throughput")
    p.add_argument("--mixed-precision", choices=["auto", "on", "off"])
    p.add_argument("--synthetic", action="store_true", default=None, help="random data, no files needed")
    p.add_argument("--synthetic-steps", type=int, help="synthetic: steps per epoch (and validation steps)")
    p.add_argument("--data", help="training class-folder tree (or TFRecord glob with --tfrecords)")
    p.add_argument("--val-data", help="validation class-folder tree (or TFRecord glob)")
    p.add_argument("--tfrecords", action="store_true", default=None)
    p.add_argument("--out", help="checkpoints, history, summary, plot (default ~/.cache/hvdx/dawnbench/<preset>)")
    p.add_argument("--keep-checkpoints", type=int, help="checkpoints kept per rank, the newest (default 3; 0: all)")
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true", default=None, help="continue from --out's newest checkpoint")
    p.add_argument("--elastic", action="store_true", default=None,
                   help="train under Elastic Horovod (launch: horovodrun --gloo --min-np --max-np "
                        "--host-discovery-script): nodes may leave and join (docs/elastic.md)")
    p.add_argument("--stop-after", type=int, help="stop after this many epochs (resume later)")
    p.add_argument("--verbose", type=int, choices=[0, 1, 2], help="Keras progress on rank 0 (default 2)")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="tf.config.experimental.enable_op_determinism()")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, help="write curves.png (default on)")
    p.add_argument("--comm-timing", action=argparse.BooleanOptionalAction,
                   help="time each strategy's aggregation for the communication share (default on)")
    p.add_argument("--dry-run", action="store_true", help="print the configuration and the plan as JSON, then exit")
    return p


def make_config(args: dict) -> Config:
    """The preset named by args["preset"], overridden by the other (non-None) flags."""
    preset = args["preset"]
    values = dict(PRESETS[preset], out=os.path.join(os.path.expanduser("~"), ".cache", "hvdx", "dawnbench", preset))
    values.update({k: v for k, v in args.items() if v is not None and k != "preset"})
    values.update(phases=ph.parse_phases(values["phases"]), widths=tuple(values.get("widths", Config.widths)))
    config = Config(**values)
    if not 0 <= config.switch_epoch <= ph.total_epochs(config.phases):
        raise ValueError(f"--switch-epoch {config.switch_epoch} is outside the {ph.total_epochs(config.phases)} epochs")
    if not (0 < config.crop_area <= 1 and config.crop_source >= 1):
        raise ValueError(f"--crop-area {config.crop_area} must be in (0, 1] and --crop-source {config.crop_source} "
                         f">= 1 (the crop is taken from an image at least as large as the phase's)")
    if config.keep_checkpoints < 0:
        raise ValueError(f"--keep-checkpoints {config.keep_checkpoints}: give how many to keep, or 0 for all")
    return config


def plan(config: Config) -> dict:
    """The configuration, each phase's epochs and resolutions, each epoch's phase and strategy."""
    starts = [ph.phase_start(config.phases, i) for i in range(len(config.phases))]
    return dict(config=dict(dataclasses.asdict(config), phases=[str(p) for p in config.phases]),
                phases=[dict(phase=str(p), epochs=[s, s + p.epochs - 1], resolution=p.resolution,
                             source_resolution=config.source_resolution(p), batch_size=p.batch_size)
                        for s, p in zip(starts, config.phases)],
                epochs=[dict(epoch=e, phase=ph.phase_at(config.phases, e)[0], communication=config.communication_at(e))
                        for e in range(ph.total_epochs(config.phases))])


def small_resnet(num_classes: int, widths: Sequence[int]) -> tf.keras.Model:
    """A ResNet of one basic block per stage (stride 2 from the second stage), any input size
    (hvdx.zoo.resnet: named layers, batch-norm momentum 0.9)."""
    return zoo.resnet(widths, num_classes, bn_momentum=0.9, name="small_resnet", keras=tf.keras)


def build_model(config: Config) -> tf.keras.Model:
    """The configured model (Keras' ResNet50 without weights, or `small_resnet`), seeded: the
    same initial weights on every rank."""
    tf.keras.utils.set_random_seed(config.seed)
    if config.model == "resnet50":
        return zoo.resnet50(config.num_classes, keras=tf.keras)
    return small_resnet(config.num_classes, config.widths)


def compiled(model: tf.keras.Model, config: Config, optimizer) -> tf.keras.Model:
    """`model` compiled with `optimizer`, label-smoothed cross-entropy, top-1 and top-5."""
    loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
    model.compile(optimizer=optimizer, loss=loss, metrics=[
        tf.keras.metrics.CategoricalAccuracy(name="top1"), tf.keras.metrics.TopKCategoricalAccuracy(5, "top5")])
    return model


def lars(config: Config, learning_rate) -> LARS:
    """LARS (eq. 11), norms by the parallel tensor operator; batch norm and biases (Keras'
    ResNet50 and the small ResNet name them "*_bn/") get no weight decay or adaptation."""
    return LARS(learning_rate=learning_rate, momentum=config.momentum, weight_decay=config.weight_decay,
                eeta=config.eeta, exclude_from_weight_decay=["bias", "_bn/", "batch_normalization"],
                min_trust_ratio=None, max_trust_ratio=config.max_trust_ratio, parallel="pto")


def open_data(config: Config, local_rank: int):
    """(training, validation) DataCache, or (None, None) for synthetic data. Collective."""
    if config.synthetic:
        return None, None
    if config.demo_data and config.data is None:  # written once per node, outside the checkout
        if local_rank == 0:
            demo.write_demo_dataset(demo.DEMO_ROOT)
        hvdx.barrier()
        config.data, config.val_data = (os.path.join(demo.DEMO_ROOT, d) for d in ("train", "val"))
    if config.data is None:
        raise ValueError("give --data (a class-folder tree, or TFRecords with --tfrecords), or --synthetic")
    kind = "tfrecords" if config.tfrecords else "root"
    train = hvdx.data.DataCache(**{kind: config.data}, resolution=config.source_resolution(config.phases[0]),
                                seed=config.seed)
    val = hvdx.data.DataCache(**{kind: config.val_data}, resolution=config.phases[0].resolution, seed=config.seed,
                              remainder="pad") if config.val_data else None
    if config.num_classes != len(getattr(train.catalog, "classes", [None] * config.num_classes)):
        raise ValueError(f"--num-classes {config.num_classes} but the data has {len(train.catalog.classes)} classes")
    return train, val


def phase_steps(config: Config, caches) -> List[int]:
    """Every phase's steps per epoch: the training DataCache's for its batch (whole batches),
    or --synthetic-steps."""
    if caches[0] is None:
        return [config.synthetic_steps] * len(config.phases)
    return [caches[0].steps_per_epoch(p.batch_size, drop_remainder=True) for p in config.phases]


def phase_data(config: Config, phase: ph.Phase, epoch: int, step: int, caches, rank: int):
    """(training batches from `epoch` / global `step` on, validation batches, validation steps)."""
    train_cache, val_cache = caches
    if train_cache is None:
        def synthetic(first_step, stream):
            return batches.synthetic_batches(config.num_classes, phase.resolution, phase.batch_size, seed=config.seed,
                                             first_step=first_step, rank=rank, stream=stream)
        return synthetic(step, 0), synthetic(0, 1), config.synthetic_steps
    common = dict(first_epoch=epoch, seed=config.seed, num_classes=config.num_classes)
    train = batches.datacache_batches(train_cache, phase.batch_size, phase.resolution, first_step=step, train=True,
                                      augment=config.augment, crop_area=config.crop_area,
                                      source_resolution=config.source_resolution(phase), **common)
    if val_cache is None:
        return train, None, None
    return train, batches.datacache_batches(val_cache, phase.batch_size, phase.resolution, first_step=0, train=False,
                                            **common), val_cache.steps_per_epoch(phase.batch_size)


def train(config: Config) -> dict:
    """Runs (or resumes) the recipe; returns the summary (on every rank). Collective."""
    import horovod.tensorflow as hvd
    import hvdx.keras.callbacks as hvd_callbacks  # Horovod's, MetricAverageCallback working on TF 2.16+ too

    topo = hvdx.init()
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    mixed = bool(tf.config.list_physical_devices("GPU")) if config.mixed_precision == "auto" \
        else config.mixed_precision == "on"  # float16 pays off on tensor cores, is slower on a CPU
    tf.keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
    def say(*args, **kwargs) -> None:  # rank 0 of the current ranks (an elastic job's change them)
        if hvdx.topology().rank == 0:
            print(*args, **kwargs)

    os.makedirs(config.out, exist_ok=True)
    start_wall = time.perf_counter()
    caches = open_data(config, topo.local_rank)
    steps = phase_steps(config, caches)
    schedule = ph.PhaseSchedule.over(config.phases, steps, config.lr, config.warmup_epochs, config.decay_power)

    # Resume: every rank reads the run's state and its own newest checkpoint.
    state_path, history, epoch = os.path.join(config.out, "state.json"), [], 0
    if config.resume:
        state = checkpoints.read_state(state_path)
        epoch, history = state["epoch"], state["history"]
    # (elastic: a process that joins later runs this while the others are in Horovod's reset,
    # so no collective here: the elastic state's sync gives every rank rank 0's epoch and model)
    epochs = [epoch] if config.elastic else hvd.allgather_object(epoch, name="dawnbench.resume_epoch")
    if len(set(epochs)) != 1:
        raise RuntimeError(f"ranks would resume at different epochs {epochs}: give every rank the same --out")
    communication = config.communication_at(epoch)
    optimizer = hvdx.DistributedOptimizer(lars(config, schedule), communication=communication,
                                          **({"density": config.density} if communication == "hitopk" else {}))
    model = compiled(build_model(config), config, optimizer)
    optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    saved = checkpoints.EpochCheckpoints(os.path.join(config.out, "checkpoints", f"rank{topo.rank}"),
                                         config.keep_checkpoints)
    if config.resume:
        checkpoint.read(os.path.join(saved.directory, state["checkpoint"])).assert_existing_objects_matched()
        say(f"resumed at epoch {epoch} (phase {state['phase']}, {state['resolution']} px, "
            f"{state['communication']}) from {saved.directory}/{state['checkpoint']}", flush=True)
    elif not config.elastic:  # rank 0's initial state everywhere, before the first step (not in a batch hook of fit)
        hvdx.broadcast_variables(model.variables, root_rank=0)  # either Keras' variables
        hvdx.broadcast_variables(optimizer.variables, root_rank=0)

    say(f"DAWNBench recipe on {topo.num_nodes} node(s) x {topo.local_size} rank(s): phases "
        f"{', '.join(map(str, config.phases))} (epochs x px @ batch per rank), HiTopK (density {config.density}) "
        f"before epoch {config.switch_epoch}, 2DTAR after; LARS (PTO), mixed precision {'on' if mixed else 'off'}, "
        f"{'synthetic data' if config.synthetic else 'DataCache'}{', elastic' if config.elastic else ''}", flush=True)
    stop = min(ph.total_epochs(config.phases), config.stop_after or ph.total_epochs(config.phases))

    def run_phases(epoch: int, history: List[dict], commit=None) -> List[dict]:
        """Trains from `epoch` to `stop` on the current ranks; `commit(epoch, history)` after
        every epoch (elastic). Returns the history."""
        topo = hvdx.topology()
        saved = checkpoints.EpochCheckpoints(os.path.join(config.out, "checkpoints", f"rank{topo.rank}"),
                                             config.keep_checkpoints)
        callbacks = [hvdx.callbacks.SwitchCommunication(config.switch_epoch, "hierarchical"),
                     hvd_callbacks.MetricAverageCallback(),  # validation metrics: the mean over ranks
                     EpochLog(config.phases, topo.size, history, history[-1]["elapsed"] if history else 0.0),
                     CheckpointCallback(saved, checkpoint, topo.rank, state_path, lambda e, name: dict(
                         epoch=e + 1, phase=history[-1]["phase"], resolution=history[-1]["resolution"],
                         communication=history[-1]["communication"], checkpoint=name, history=history))]
        if commit is not None:
            callbacks.append(tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: commit(e + 1, history)))
        while epoch < stop:
            index, phase = ph.phase_at(config.phases, epoch)
            end = min(ph.phase_start(config.phases, index) + phase.epochs, stop)
            train_ds, val_ds, val_steps = phase_data(config, phase, epoch, ph.first_step(config.phases, steps, epoch),
                                                     caches, topo.rank)
            hvdx.callbacks.check_same_steps({"steps": steps[index], "epochs": end})
            say(f"phase {index}: epochs {epoch}-{end - 1} at {phase.resolution} px, batch {phase.batch_size} per "
                f"rank ({phase.batch_size * topo.size} global), {steps[index]} steps per epoch", flush=True)
            model.fit(train_ds, steps_per_epoch=steps[index], initial_epoch=epoch, epochs=end, validation_data=val_ds,
                      validation_steps=val_steps, verbose=config.verbose if topo.rank == 0 else 0,
                      callbacks=callbacks, shuffle=False)  # the pipeline shuffles (Keras 3 warns at True)
            epoch = end
        return history

    if config.elastic:
        history = elastic_phases(run_phases, model, caches, config, steps, schedule, epoch, history)
    else:
        history = run_phases(epoch, history)
    topo = hvdx.topology()
    summary = summarize(config, history, topo, model, time.perf_counter() - start_wall)
    if topo.rank == 0:
        checkpoints.write_json(os.path.join(config.out, "summary.json"), summary)
        print_summary(config, summary)
        if config.plot:
            plot_curves(history, config.phases, os.path.join(config.out, "curves.png"),
                        f"DAWNBench recipe: {', '.join(map(str, config.phases))}",
                        marks={config.switch_epoch: "HiTopK -> 2DTAR"})
    # returned, not written (the tests compare runs): batch norm's moving statistics are each
    # rank's own, the trainable weights the same on every rank
    summary.update(weights=model.get_weights(), trainable_weights=[v.numpy() for v in model.trainable_variables])
    for cache in caches:
        if cache is not None:
            cache.close()
    hvdx.barrier()
    return summary


def elastic_phases(run_phases, model: tf.keras.Model, caches, config: Config, steps: List[int],
                   schedule: ph.PhaseSchedule, epoch: int, history: List[dict]) -> List[dict]:
    """`run_phases` under Elastic Horovod (`hvdx.elastic.run`): the model, its optimizer, the
    epoch and the history are committed after every epoch; after a membership change the
    job goes on from the last committed epoch on the new ranks. hvdx's reset has split the
    DataCache again (docs/elastic.md): the steps per epoch are counted again, the learning
    rate schedule maps the optimizer's step to the epoch with them, the optimizer's step is
    set to the epoch's first, and a process that joins after the switch to 2DTAR switches
    too. Returns the history."""
    import hvdx.elastic

    state = hvdx.elastic.KerasState(model, epoch=epoch, history=list(history))

    def commit(done: int, history: List[dict]) -> None:
        state.epoch, state.history = done, list(history)  # copies: the saved state is never appended to
        state.commit()  # a changed host list interrupts here (HostsUpdatedInterrupt)

    @hvdx.elastic.run
    def train_elastic(state) -> List[dict]:
        steps[:] = phase_steps(config, caches)  # the DataCache's split for these ranks
        schedule.steps_per_epoch = list(steps)  # read when the step is traced again (after a reset)
        model.optimizer.iterations.assign(ph.first_step(config.phases, steps, state.epoch))
        if state.epoch >= config.switch_epoch:  # a process that joined after the switch: the ranks' strategy
            hvdx.callbacks.switch(model, "hierarchical")
        return run_phases(state.epoch, list(state.history), commit)

    return train_elastic(state)


def summarize(config: Config, history: List[dict], topo, model: tf.keras.Model, wall: float) -> dict:
    """Per phase: throughput, communication share, scaling efficiency (hvdx.throughput); the
    final metrics; the time to the target. Collective."""
    rows = throughput.phase_throughput(history, config.phases)
    comm = {}
    if config.comm_timing:  # each strategy aggregating the model's gradient buffer alone
        d = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        comm = {type(s).__name__: throughput.comm_time(s, d, topo.rank)
                for s in (hvdx.comm.HiTopK(density=config.density), hvdx.comm.Hierarchical())}
        throughput.comm_shares(rows, comm)
    if config.baseline_json:
        throughput.scaling_efficiency(rows, topo.size, throughput.load_baseline(config.baseline_json),
                                      config.baseline_json)
    elif config.se_steps > 0 and rows:
        alone = compiled(build_model(config), config, lars(config, 1e-4))  # a copy, no communication
        single = throughput.single_rank_throughput(alone, config.phases, config.se_steps, topo.rank, config.num_classes)
        throughput.scaling_efficiency(rows, topo.size, single, f"{config.se_steps} steps per phase on each rank alone")
    (metric, goal), last = config.target, (history[-1] if history else {})
    reached = first_reaching(history, metric, goal)
    return dict(ranks=topo.size, nodes=topo.num_nodes, epochs=len(history), wall_s=wall,
                trained_s=last.get("elapsed"), target={metric: goal},
                reached=reached and dict(epoch=reached["epoch"], elapsed_s=reached["elapsed"], value=reached[metric]),
                final={k: last[k] for k in ("top1", "top5", "val_top1", "val_top5", "loss") if k in last},
                phases=rows, comm_s=comm, history=history)


def print_summary(config: Config, s: dict) -> None:
    print("\n" + throughput.table(s["phases"], s["ranks"], s["nodes"]), flush=True)
    print(f"after {s['epochs']} epochs: {', '.join(f'{k} {v:.4f}' for k, v in s['final'].items())}", flush=True)
    (metric, goal), = s["target"].items()
    print(f"target {metric} >= {goal} " + (f"reached in epoch {s['reached']['epoch'] + 1} after "
                                           f"{s['reached']['elapsed_s']:.1f} s of training" if s["reached"]
                                           else "NOT reached"), flush=True)
    print(f"wall time {s['wall_s']:.1f} s (this process; training {s['trained_s'] or 0:.1f} s over all runs); "
          f"summary, history and curves in {config.out}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Trains as the flags say and returns the summary; with --dry-run prints and returns the plan."""
    args = vars(parser().parse_args(argv))
    dry_run = args.pop("dry_run")
    config = make_config(args)
    if dry_run:
        print(json.dumps(plan(config), indent=1))
        return plan(config)
    return train(config)


if __name__ == "__main__":
    main()
