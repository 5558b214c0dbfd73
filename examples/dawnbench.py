"""The DAWNBench ResNet-50 recipe of shi2021 (secs. 5.5-5.6, Tables 4-5) as one script, every
hvdx technique composed the way the paper's training job composes them:

- progressive resizing: a list of phases (epochs x resolution @ local batch), the paper's
  13 x 96 px @ 256, 11 x 128 @ 256, 3 x 224 @ 256, 1 x 288 @ 128;
- MSTopK-SGD with HiTopKComm (Alg. 2) in the low-resolution epochs, then dense 2DTAR
  (`hvdx.callbacks.SwitchCommunication` at `--switch-epoch`);
- LARS (eq. 11) with its layer norms computed in parallel (PTO, eqs. 12-14), trust-ratio
  clipping, no weight decay on batch-norm and bias; learning-rate warm-up and polynomial
  decay; label smoothing; mixed precision where the device has it;
- DataCache input (sec. 4.1) from a class-folder tree of JPEGs or TFRecords, decoded at each
  phase's resolution; seeded, resumable data order and augmentation;
- a checkpoint every epoch (per rank: weights, LARS state, error-feedback residuals; plus
  epoch, phase, resolution and strategy) and `--resume`; top-1 / top-5 each epoch, time to
  the target accuracy, per-phase throughput (Table 4), a summary and a PNG of the curves.

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/dawnbench.py --preset demo
    horovodrun -np 128 -H node1:8,...,node16:8 python examples/dawnbench.py --preset imagenet \
        --data /nfs/imagenet/train --val-data /nfs/imagenet/val
    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/dawnbench.py --preset smoke --synthetic

Any preset value can be overridden (`--phases 2x64@32,1x96@16 --switch-epoch 2 --lr 4`).
docs/dawnbench.md explains the recipe and how it maps to the paper.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

# -- configuration: phases and presets ------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """`epochs` epochs at `resolution` px (square) with `batch_size` samples per rank."""

    epochs: int
    resolution: int
    batch_size: int

    def __str__(self) -> str:
        return f"{self.epochs}x{self.resolution}@{self.batch_size}"


PHASE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*@\s*(\d+)\s*$")


def parse_phases(spec: str) -> List[Phase]:
    """Phases from "EPOCHSxRESOLUTION@BATCH,..." (e.g. "13x96@256,11x128@256").

    Raises ValueError naming the bad item (every number must be a positive integer)."""
    phases = []
    for item in spec.split(","):
        match = PHASE.match(item)
        if not match or min(int(g) for g in match.groups()) < 1:
            raise ValueError(f"bad phase {item!r} in {spec!r}: write EPOCHSxRESOLUTION@BATCH with positive "
                             f"integers, phases separated by commas, e.g. 13x96@256,11x128@256")
        phases.append(Phase(*(int(g) for g in match.groups())))
    return phases


@dataclass
class Config:
    """Everything a run depends on; a preset fills it, flags override it."""

    phases: List[Phase]
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
    augment: str = "flip"             # flip (crop + mirror) | shift (crop only: digits are not symmetric)
    #                                   | rrc (random-resized crop + mirror) | rrc-noflip | none
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
    seed: int = 0
    resume: bool = False
    stop_after: Optional[int] = None  # stop after this many epochs in total (a pre-emption)
    verbose: int = 2
    deterministic: bool = False
    plot: bool = True
    comm_timing: bool = True
    se_steps: int = 0                 # > 0: time this many steps of each phase on each rank alone (SE)
    baseline_json: Optional[str] = None  # or: a 1-rank run's summary.json gives the 1-rank throughput

    def source_resolution(self, phase: "Phase") -> int:
        """The resolution DataCache serves a training phase at: the phase's, or with random-
        resized crop `crop_source` x it (the crop is taken from the larger image)."""
        if self.augment.startswith("rrc"):
            return max(phase.resolution, int(round(self.crop_source * phase.resolution)))
        return phase.resolution

    @property
    def total_epochs(self) -> int:
        return sum(p.epochs for p in self.phases)

    def phase_at(self, epoch: int) -> Tuple[int, Phase]:
        """(index, phase) of `epoch` (0-based)."""
        start = 0
        for i, phase in enumerate(self.phases):
            if epoch < start + phase.epochs:
                return i, phase
            start += phase.epochs
        raise ValueError(f"epoch {epoch} is past the last phase (training has {self.total_epochs} epochs)")

    def phase_start(self, index: int) -> int:
        return sum(p.epochs for p in self.phases[:index])

    def communication_at(self, epoch: int) -> str:
        return "hitopk" if epoch < self.switch_epoch else "hierarchical"


PRESETS: Dict[str, dict] = {
    # shi2021 sec. 5.6 / Table 4: 28 epochs, HiTopK for the 13 epochs at 96 px, then 2DTAR. The
    # paper gives neither the learning rate nor the warm-up: these are in the range published LARS
    # recipes use for a 32K batch (128 ranks x 256), neither tuned nor run at that scale here.
    "imagenet": dict(phases="13x96@256,11x128@256,3x224@256,1x288@128", switch_epoch=13, lr=29.0,
                     warmup_epochs=2.0, weight_decay=5e-5, model="resnet50", num_classes=1000,
                     target=("val_top5", 0.93), augment="rrc", crop_area=0.08, crop_source=1.25, density=0.01,
                     se_steps=20),
    # `make demo`: a small ResNet on upscaled, augmented scikit-learn digits written as JPEG class
    # folders; 3 phases, HiTopK then 2DTAR; random-resized crop of at least half the image, no
    # mirror (digits are not symmetric). Reaches val top-1 >= 0.9 (the stated target).
    "demo": dict(phases="3x24@32,2x32@32,1x40@16", switch_epoch=3, lr=8.0, warmup_epochs=1.0,
                 weight_decay=5e-5, model="small", widths=(16, 32, 64), num_classes=10,
                 target=("val_top1", 0.90), augment="rrc-noflip", crop_area=0.5, crop_source=1.25, density=0.05,
                 eeta=0.01, max_trust_ratio=1.0,
                 demo_data=True, se_steps=5),
    # the tests' smoke run: tiny model, 2 short phases, synthetic data
    "smoke": dict(phases="2x8@4,1x12@2", switch_epoch=2, lr=1.0, warmup_epochs=0.5, model="small",
                  widths=(4, 8), num_classes=4, target=("val_top1", 0.5), synthetic=True, synthetic_steps=3,
                  density=0.1, eeta=0.01, max_trust_ratio=1.0),
}


def make_config(argv: Optional[Sequence[str]] = None) -> Config:
    """The preset named by --preset, overridden by the other flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--phases", help="EPOCHSxRESOLUTION@BATCH,... (batch per rank)")
    parser.add_argument("--switch-epoch", type=int, help="epoch (0-based) from which 2DTAR replaces HiTopK")
    for name in ("lr", "warmup-epochs", "decay-power", "momentum", "weight-decay", "eeta", "label-smoothing",
                 "density", "max-trust-ratio"):
        parser.add_argument(f"--{name}", type=float)
    parser.add_argument("--model", choices=["resnet50", "small"])
    parser.add_argument("--num-classes", type=int)
    parser.add_argument("--augment", choices=["flip", "shift", "rrc", "rrc-noflip", "none"],
                        help="flip: pad-and-crop + mirror; shift: pad-and-crop; rrc: random-resized crop + mirror")
    parser.add_argument("--crop-area", type=float, help="rrc: smallest crop area, a fraction of the image's")
    parser.add_argument("--crop-source", type=float,
                        help="rrc: DataCache stores each phase's samples at this x its resolution (>= 1)")
    parser.add_argument("--se-steps", type=int, help="after training, time this many steps of each phase on "
                                                     "every rank alone: the 1-rank throughput of SE (Table 4)")
    parser.add_argument("--baseline-json", help="a 1-rank run's summary.json: its per-phase samples/s are the "
                                                "1-rank throughput of SE (instead of --se-steps)")
    parser.add_argument("--mixed-precision", choices=["auto", "on", "off"])
    parser.add_argument("--synthetic", action="store_true", default=None, help="random data, no files needed")
    parser.add_argument("--data", help="training class-folder tree (or TFRecord glob with --tfrecords)")
    parser.add_argument("--val-data", help="validation class-folder tree (or TFRecord glob)")
    parser.add_argument("--tfrecords", action="store_true", default=None)
    parser.add_argument("--out", help="checkpoints, history, summary and plot "
                                      "(default: ~/.cache/hvdx/dawnbench/<preset>)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--resume", action="store_true", default=None, help="continue from --out's checkpoint")
    parser.add_argument("--stop-after", type=int, help="stop after this many epochs (resume later)")
    parser.add_argument("--verbose", type=int, choices=[0, 1, 2], help="Keras progress on rank 0 (default 2)")
    parser.add_argument("--deterministic", action="store_true", default=None,
                        help="tf.config.experimental.enable_op_determinism()")
    args = vars(parser.parse_args(argv))
    preset = args.pop("preset")
    values = dict(PRESETS[preset], out=os.path.join(os.path.expanduser("~"), ".cache", "hvdx", "dawnbench", preset))
    values.update({k: v for k, v in args.items() if v is not None})
    values["phases"] = parse_phases(values["phases"]) if isinstance(values["phases"], str) else values["phases"]
    values["widths"] = tuple(values.get("widths", Config.widths))
    config = Config(**values)
    if not 0 <= config.switch_epoch <= config.total_epochs:
        raise ValueError(f"--switch-epoch {config.switch_epoch} is outside the {config.total_epochs} epochs")
    if not (0 < config.crop_area <= 1 and config.crop_source >= 1):
        raise ValueError(f"--crop-area {config.crop_area} must be in (0, 1] and --crop-source {config.crop_source} "
                         f">= 1 (the crop is taken from an image at least as large as the phase's)")
    return config


# -- learning rate: warm-up, then polynomial decay, over epochs of every phase ---------------


@tf.keras.utils.register_keras_serializable(package="dawnbench")
class PhaseSchedule(tf.keras.optimizers.schedules.LearningRateSchedule):
    """lr(step) for phases of different steps per epoch: the step is mapped to a fractional
    epoch e, then lr = peak (0.1 + 0.9 e / W) for e < W, peak ((T - e) / (T - W))^power after,
    times the phase's batch / the first phase's batch (linear scaling: the paper's last phase
    halves the batch)."""

    def __init__(self, peak: float, warmup_epochs: float, total_epochs: int, power: float,
                 steps_per_epoch: Sequence[int], epochs: Sequence[int], batch_scale: Sequence[float]) -> None:
        self.peak, self.warmup_epochs, self.total_epochs, self.power = peak, warmup_epochs, total_epochs, power
        self.steps_per_epoch, self.epochs, self.batch_scale = list(steps_per_epoch), list(epochs), list(batch_scale)

    def epoch(self, step) -> tf.Tensor:
        """The fractional epoch at optimizer step `step` (0-based)."""
        step = tf.cast(step, tf.float64)
        epoch, start = tf.constant(0.0, tf.float64), 0
        for steps, epochs in zip(self.steps_per_epoch, self.epochs):
            epoch += tf.clip_by_value((step - start) / steps, 0.0, float(epochs))
            start += steps * epochs
        return epoch

    def __call__(self, step):
        e = self.epoch(step)
        w, t = max(self.warmup_epochs, 1e-9), float(self.total_epochs)
        warm = 0.1 + 0.9 * e / w
        decay = tf.maximum((t - e) / max(t - self.warmup_epochs, 1e-9), 0.0) ** self.power
        scale = tf.constant(self.batch_scale[-1], tf.float64)
        for s, n in reversed(list(zip(self.batch_scale[:-1], np.cumsum(self.epochs)[:-1]))):
            scale = tf.where(e < float(n), tf.constant(s, tf.float64), scale)
        return tf.cast(self.peak * scale * tf.where(e < w, warm, decay), tf.float32)

    def get_config(self) -> dict:
        return dict(peak=self.peak, warmup_epochs=self.warmup_epochs, total_epochs=self.total_epochs,
                    power=self.power, steps_per_epoch=self.steps_per_epoch, epochs=self.epochs,
                    batch_scale=self.batch_scale)


# -- data ------------------------------------------------------------------------------------


def write_demo_dataset(root: str, copies: int = 3, size: int = 48, seed: int = 0) -> Tuple[str, str]:
    """Writes scikit-learn's digits once as JPEG class folders, train/ and val/ under `root`
    (train: `copies` randomly shifted, scaled and tinted copies of 75 % of the digits; val:
    the other 25 %, once, untouched); returns (train, val). Atomic: a finished tree is
    renamed into place, so concurrent writers (one per node) and interrupted runs are safe."""
    train, val = os.path.join(root, "train"), os.path.join(root, "val")
    if os.path.isdir(train) and os.path.isdir(val):
        return train, val
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(digits.images, digits.target, test_size=0.25,
                                                      random_state=seed, stratify=digits.target)
    rng = np.random.default_rng(seed)
    tmp = f"{root}.tmp-{os.getpid()}"

    def write(folder: str, images: np.ndarray, labels: np.ndarray, copies: int, jitter: bool) -> None:
        for label in range(10):
            os.makedirs(os.path.join(tmp, folder, f"{label}"), exist_ok=True)
        for i, (image, label) in enumerate(zip(images, labels)):
            for c in range(copies):
                scale = rng.uniform(0.7, 1.0) if jitter else 0.85
                inner = int(round(size * scale))
                digit = tf.image.resize(image[..., None] / 16.0, [inner, inner], "bicubic").numpy()
                canvas = np.zeros([size, size, 1], np.float32)
                dy, dx = rng.integers(0, size - inner + 1, 2) if jitter else [(size - inner) // 2] * 2
                canvas[dy:dy + inner, dx:dx + inner] = np.clip(digit, 0, 1)
                ink = rng.uniform(0.6, 1.0, 3) if jitter else np.ones(3)
                paper = rng.uniform(0.0, 0.3, 3) if jitter else np.zeros(3)
                rgb = paper + canvas * (ink - paper) + (rng.normal(0, 0.03, [size, size, 3]) if jitter else 0)
                pixels = tf.constant(np.clip(rgb * 255, 0, 255).astype(np.uint8))
                path = os.path.join(tmp, folder, f"{label}", f"{i:05d}-{c}.jpg")
                tf.io.write_file(path, tf.io.encode_jpeg(pixels, quality=90))

    write("train", x_train, y_train, copies, jitter=True)
    write("val", x_val, y_val, 1, jitter=False)
    try:
        os.rename(tmp, root)
    except OSError:  # another node's writer finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return train, val


#: Random-resized crop's aspect ratios (width / height), log-uniform: ImageNet training's range.
CROP_RATIOS = (3 / 4, 4 / 3)


def random_resized_crop(images: tf.Tensor, seeds: tf.Tensor, size: int, min_area: float = 0.08,
                        flip: bool = True) -> tf.Tensor:
    """ImageNet training's augmentation, per sample and stateless (seeded by `seeds` [B, 2]): a
    box of area fraction a ~ U(min_area, 1) of the image and aspect ratio r (log-uniform in
    CROP_RATIOS), sides h = sqrt(a / r), w = sqrt(a r) (clipped to the image), placed
    uniformly at random, resized bilinearly to size x size; then mirrored left-right with
    probability 1/2 if `flip`. Batched (one crop_and_resize per batch).

    Args:
        images: uint8 [B, H, W, C], the cached images (larger than `size`: DataCache keeps
            them at `Config.crop_source` x the phase's resolution).
        seeds: int64 [B, 2], one seed per sample.
    Returns:
        uint8 [B, size, size, C].
    """
    u = tf.map_fn(lambda seed: tf.random.stateless_uniform([5], seed), seeds, fn_output_signature=tf.float32)
    area = min_area + (1.0 - min_area) * u[:, 0]
    low, high = np.log(CROP_RATIOS[0]), np.log(CROP_RATIOS[1])
    ratio = tf.exp(low + (high - low) * u[:, 1])
    h, w = tf.minimum(tf.sqrt(area / ratio), 1.0), tf.minimum(tf.sqrt(area * ratio), 1.0)
    y0, x0 = (1.0 - h) * u[:, 2], (1.0 - w) * u[:, 3]
    boxes = tf.stack([y0, x0, y0 + h, x0 + w], axis=1)
    out = tf.image.crop_and_resize(tf.cast(images, tf.float32), boxes, tf.range(tf.shape(images)[0]), [size, size])
    if flip:
        out = tf.where((u[:, 4] < 0.5)[:, None, None, None], tf.reverse(out, axis=[2]), out)
    return tf.cast(tf.clip_by_value(tf.round(out), 0.0, 255.0), tf.uint8)


def augment_batch(images: tf.Tensor, seeds: tf.Tensor, kind: str, size: Optional[int] = None,
                  min_area: float = 0.08) -> tf.Tensor:
    """Per sample, stateless (seeded by `seeds` [B, 2], so a resumed run draws the same):
    "flip" / "shift": pad by 1/8 and crop back (translation), "flip" also mirrors left-right;
    "rrc" / "rrc-noflip": `random_resized_crop` to `size` (with / without the mirror);
    "none": unchanged. uint8 in, uint8 out; the pad-and-crop kinds keep the size."""
    if kind == "none":
        return images
    if kind.startswith("rrc"):
        if size is None:
            raise ValueError("random-resized crop needs the output size")
        return random_resized_crop(images, seeds, size, min_area, flip=kind == "rrc")
    size = tf.shape(images)[1:3]
    pad = tf.maximum(size // 8, 1)

    def one(args):
        image, seed = args
        padded = tf.pad(image, [[pad[0], pad[0]], [pad[1], pad[1]], [0, 0]], mode="REFLECT")
        image = tf.image.stateless_random_crop(padded, tf.shape(image), seed)
        if kind == "flip":
            image = tf.image.stateless_random_flip_left_right(image, seed + 1)
        return image

    return tf.map_fn(one, (images, seeds), fn_output_signature=images.dtype)


def to_model_input(images: tf.Tensor, labels: tf.Tensor, num_classes: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """uint8 images to floats in [-1, 1]; labels one-hot (label smoothing needs them)."""
    x = tf.cast(images, tf.float32) / 127.5 - 1.0
    return x, tf.one_hot(tf.cast(labels, tf.int32), num_classes)


def synthetic_batches(config: Config, phase: Phase, first_step: int, rank: int, stream: int) -> tf.data.Dataset:
    """Learnable random data, a pure function of (seed, stream, global step, rank): class c's
    images are a fixed 4x4 colour pattern of class c, upscaled, plus noise."""
    num_classes, res, batch = config.num_classes, phase.resolution, phase.batch_size
    patterns = tf.random.stateless_uniform([num_classes, 4, 4, 3], [config.seed, 99])

    def make(step):
        seed = tf.stack([tf.cast(config.seed * 7919 + stream, tf.int64), step * 1024 + rank])
        labels = tf.random.stateless_uniform([batch], seed, 0, num_classes, tf.int32)
        base = tf.image.resize(tf.gather(patterns, labels), [res, res], "nearest")
        noise = tf.random.stateless_normal([batch, res, res, 3], seed + 1, stddev=0.3)
        x = tf.clip_by_value(base + noise, 0.0, 1.0) * 2.0 - 1.0
        return x, tf.one_hot(labels, num_classes)

    return tf.data.Dataset.range(first_step, 2**62).map(make).prefetch(2)


def datacache_batches(cache, config: Config, phase: Phase, epoch: int, first_step: int, train: bool) -> tf.data.Dataset:
    """This rank's batches from `cache` (hvdx.data.DataCache) at the phase's resolution, from
    `epoch` on, forever (Model.fit takes steps_per_epoch): the data order is DataCache's
    (seed, epoch) order, the augmentation is seeded by (seed, global step, sample id). With
    random-resized crop, training batches are read at `config.source_resolution(phase)`
    (DataCache keeps that size) and cropped to the phase's; validation reads the phase's."""
    batch = phase.batch_size
    resolution = config.source_resolution(phase) if train else phase.resolution
    ds = cache.dataset(batch, resolution=resolution, epochs=None, first_epoch=epoch, with_index=True,
                       drop_remainder=train)
    if train:
        steps = tf.data.Dataset.range(first_step, 2**62)

        def augmented(step, batch_data):
            images, labels, ids = batch_data
            seeds = tf.stack([tf.fill(tf.shape(ids), step * 1000 + config.seed), ids], axis=1)
            images = augment_batch(images, seeds, config.augment, phase.resolution, config.crop_area)
            return to_model_input(images, labels, config.num_classes)

        return tf.data.Dataset.zip((steps, ds)).map(augmented, num_parallel_calls=tf.data.AUTOTUNE,
                                                      deterministic=True).prefetch(2)
    return ds.map(lambda x, y, i: to_model_input(x, y, config.num_classes)).prefetch(2)


# -- model and optimizer ---------------------------------------------------------------------


def small_resnet(num_classes: int, widths: Sequence[int]) -> tf.keras.Model:
    """A ResNet of one basic block per stage (stride 2 from the second stage), any input size."""
    def conv_bn(x, filters, stride, name, relu=True):
        x = tf.keras.layers.Conv2D(filters, 3, stride, "same", use_bias=False, name=f"{name}_conv")(x)
        x = tf.keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_bn")(x)
        return tf.keras.layers.ReLU(name=f"{name}_relu")(x) if relu else x

    inputs = tf.keras.Input([None, None, 3])
    x = conv_bn(inputs, widths[0], 1, "stem")
    for s, width in enumerate(widths):
        stride = 1 if s == 0 else 2
        y = conv_bn(x, width, stride, f"stage{s}_a")
        y = conv_bn(y, width, 1, f"stage{s}_b", relu=False)
        if stride != 1 or x.shape[-1] != width:
            x = tf.keras.layers.Conv2D(width, 1, stride, use_bias=False, name=f"stage{s}_proj_conv")(x)
            x = tf.keras.layers.BatchNormalization(momentum=0.9, name=f"stage{s}_proj_bn")(x)
        x = tf.keras.layers.ReLU(name=f"stage{s}_out")(tf.keras.layers.Add(name=f"stage{s}_add")([x, y]))
    x = tf.keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = tf.keras.layers.Dense(num_classes, name="logits", dtype="float32")(x)
    return tf.keras.Model(inputs, outputs, name="small_resnet")


def build_model(config: Config) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(config.seed)  # the same initial weights everywhere (also broadcast)
    if config.model == "resnet50":
        base = tf.keras.applications.ResNet50(weights=None, include_top=False, input_shape=(None, None, 3),
                                              pooling="avg")
        outputs = tf.keras.layers.Dense(config.num_classes, name="logits", dtype="float32")(base.output)
        return tf.keras.Model(base.input, outputs, name="resnet50")
    return small_resnet(config.num_classes, config.widths)


# Batch-norm parameters (Keras' ResNet50 names them "*_bn/", the small ResNet too) and biases
# get no weight decay and no layer adaptation.
NO_DECAY = ["bias", "_bn/", "batch_normalization"]


def build_optimizer(config: Config, schedule: tf.keras.optimizers.schedules.LearningRateSchedule,
                    communication: str):
    """LARS (eq. 11; norms by the parallel tensor operator) under hvdx's DistributedOptimizer."""
    import hvdx
    from hvdx.optimizers import LARS

    lars = LARS(learning_rate=schedule, momentum=config.momentum, weight_decay=config.weight_decay,
                eeta=config.eeta, exclude_from_weight_decay=NO_DECAY, min_trust_ratio=None,
                max_trust_ratio=config.max_trust_ratio, parallel="pto")
    options = {"density": config.density} if communication == "hitopk" else {}
    return hvdx.DistributedOptimizer(lars, communication=communication, **options)


def use_mixed_precision(mode: str) -> bool:
    """"auto": on where a GPU is visible (float16 pays off on tensor cores; on a CPU it is
    slower, so it stays off); "on" / "off" as said."""
    on = bool(tf.config.list_physical_devices("GPU")) if mode == "auto" else mode == "on"
    tf.keras.mixed_precision.set_global_policy("mixed_float16" if on else "float32")
    return on


# -- callbacks: history, checkpoints ---------------------------------------------------------


class EpochLog(tf.keras.callbacks.Callback):
    """Per epoch: phase, resolution, batch, strategy, learning rate, wall time (`seconds`: the
    training steps, `epoch_seconds`: with validation), step time and samples/s (over all
    ranks) of the training steps after the epoch's first (which may trace), the
    (rank-averaged) metrics."""

    def __init__(self, config: Config, size: int, history: List[dict], elapsed: float) -> None:
        super().__init__()
        self.config, self.size, self.history = config, size, history
        self.elapsed = elapsed  # wall time of the epochs before this process (a resumed run)

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        self.started, self.trained, self.first_step = time.perf_counter(), None, None

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        if batch == 0:  # the first step of an epoch may trace (a new phase's shape): samples/s leave it out
            self.first_step = time.perf_counter() - self.started

    def on_test_begin(self, logs=None) -> None:
        # Model.fit runs validation inside the epoch: the training steps' time ends here
        if self.trained is None:
            self.trained = time.perf_counter() - self.started

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        epoch_seconds = time.perf_counter() - self.started
        seconds = epoch_seconds if self.trained is None else self.trained  # training steps only
        self.elapsed += epoch_seconds
        index, phase = self.config.phase_at(epoch)
        optimizer = self.model.optimizer
        while not hasattr(optimizer, "communication") and hasattr(optimizer, "inner_optimizer"):
            optimizer = optimizer.inner_optimizer
        steps = self.params["steps"]
        timed_steps, timed = (steps - 1, seconds - self.first_step) if self.first_step is not None and steps > 1 \
            else (steps, seconds)
        record = dict(epoch=epoch, phase=index, resolution=phase.resolution, batch_size=phase.batch_size,
                      communication=type(optimizer.communication).__name__, steps=steps, seconds=seconds,
                      epoch_seconds=epoch_seconds, elapsed=self.elapsed, step_s=timed / timed_steps,
                      samples_per_s=timed_steps * phase.batch_size * self.size / timed,
                      lr=float(optimizer.inner_optimizer.learning_rate),
                      **{k: float(v) for k, v in (logs or {}).items()})
        self.history.append(record)


class Checkpoint(tf.keras.callbacks.Callback):
    """After every epoch, every rank writes its own checkpoint (weights, LARS' momenta, its
    error-feedback residuals, the step counter) and rank 0 the run's state (state.json)."""

    def __init__(self, out: str, rank: int, history: List[dict], checkpoint: tf.train.Checkpoint) -> None:
        super().__init__()
        self.out, self.rank, self.history, self.checkpoint = out, rank, history, checkpoint

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        path = self.checkpoint.write(os.path.join(self.out, "checkpoints", f"rank{self.rank}", f"epoch{epoch + 1}"))
        if self.rank == 0:
            last = self.history[-1]
            write_json(os.path.join(self.out, "state.json"), {
                "epoch": epoch + 1, "phase": last["phase"], "resolution": last["resolution"],
                "communication": last["communication"], "checkpoint": os.path.basename(path),
                "history": self.history})


def write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# -- the run ---------------------------------------------------------------------------------


def train(config: Config) -> dict:
    """Runs (or resumes) the recipe; returns the summary (on every rank). Collective."""
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras.callbacks as hvd_callbacks

    import hvdx

    topo = hvdx.init()
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    mixed = use_mixed_precision(config.mixed_precision)
    say = print if topo.rank == 0 else (lambda *a, **k: None)
    os.makedirs(config.out, exist_ok=True)
    start_wall = time.perf_counter()

    # Input: synthetic, or DataCache over folders / TFRecords (the demo writes its folders once
    # per node, outside the checkout).
    train_cache = val_cache = None
    if config.demo_data and not config.synthetic and config.data is None:
        root = os.path.join(os.path.expanduser("~"), ".cache", "hvdx", "dawnbench-demo-v1")
        if topo.local_rank == 0:
            os.makedirs(os.path.dirname(root), exist_ok=True)
            write_demo_dataset(root)
        hvdx.barrier()
        config.data, config.val_data = os.path.join(root, "train"), os.path.join(root, "val")
    if not config.synthetic:
        if config.data is None:
            raise ValueError("give --data (a class-folder tree, or TFRecords with --tfrecords), or --synthetic")
        first = config.phases[0].resolution
        kind = "tfrecords" if config.tfrecords else "root"
        train_cache = hvdx.data.DataCache(**{kind: config.data}, resolution=config.source_resolution(config.phases[0]),
                                          seed=config.seed)
        if config.val_data:
            val_cache = hvdx.data.DataCache(**{kind: config.val_data}, resolution=first, seed=config.seed,
                                            remainder="pad")
        if config.num_classes != len(getattr(train_cache.catalog, "classes", [None] * config.num_classes)):
            raise ValueError(f"--num-classes {config.num_classes} but the data has "
                             f"{len(train_cache.catalog.classes)} classes")

    def steps_per_epoch(phase: Phase) -> int:
        if train_cache is None:
            return config.synthetic_steps
        return train_cache.steps_per_epoch(phase.batch_size, drop_remainder=True)

    steps = [steps_per_epoch(p) for p in config.phases]
    schedule = PhaseSchedule(config.lr, config.warmup_epochs, config.total_epochs, config.decay_power, steps,
                             [p.epochs for p in config.phases],
                             [p.batch_size / config.phases[0].batch_size for p in config.phases])

    # Resume: every rank reads the run's state and its own checkpoint.
    history: List[dict] = []
    epoch = 0
    state_path = os.path.join(config.out, "state.json")
    if config.resume:
        if not os.path.exists(state_path):
            raise FileNotFoundError(f"--resume: no {state_path}; run without --resume first")
        with open(state_path) as f:
            state = json.load(f)
        epoch, history = state["epoch"], state["history"]
    states = hvd.allgather_object(epoch, name="dawnbench.resume_epoch")
    if len(set(states)) != 1:
        raise RuntimeError(f"ranks would resume at different epochs {states}: give every rank the same --out")

    model = build_model(config)
    optimizer = build_optimizer(config, schedule, config.communication_at(epoch))
    loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
    model.compile(optimizer=optimizer, loss=loss, metrics=[
        tf.keras.metrics.CategoricalAccuracy(name="top1"), tf.keras.metrics.TopKCategoricalAccuracy(5, "top5")])
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    if config.resume:
        optimizer.build(model.trainable_variables)
        path = os.path.join(config.out, "checkpoints", f"rank{topo.rank}", state["checkpoint"])
        checkpoint.read(path).assert_existing_objects_matched()
        say(f"resumed at epoch {epoch} (phase {state['phase']}, {state['resolution']} px, "
            f"{state['communication']}) from {path}", flush=True)

    say(f"DAWNBench recipe on {topo.num_nodes} node(s) x {topo.local_size} rank(s): phases "
        f"{', '.join(map(str, config.phases))} (epochs x px @ batch per rank), HiTopK (density {config.density}) "
        f"before epoch {config.switch_epoch}, 2DTAR after; LARS (PTO), mixed precision {'on' if mixed else 'off'}, "
        f"{'synthetic data' if config.synthetic else 'DataCache'}", flush=True)
    stop = min(config.total_epochs, config.stop_after or config.total_epochs)
    log = EpochLog(config, topo.size, history, history[-1]["elapsed"] if history else 0.0)
    fresh = epoch == 0
    while epoch < stop:
        index, phase = config.phase_at(epoch)
        end = min(config.phase_start(index) + phase.epochs, stop)
        first_step = sum(s * p.epochs for s, p in zip(steps[:index], config.phases[:index])) \
            + (epoch - config.phase_start(index)) * steps[index]
        if train_cache is None:
            train_ds = synthetic_batches(config, phase, first_step, topo.rank, stream=0)
            val_ds, val_steps = synthetic_batches(config, phase, 0, topo.rank, stream=1), config.synthetic_steps
        else:
            train_ds = datacache_batches(train_cache, config, phase, epoch, first_step, train=True)
            val_ds = val_steps = None
            if val_cache is not None:
                val_ds = datacache_batches(val_cache, config, phase, epoch, 0, train=False)
                val_steps = val_cache.steps_per_epoch(phase.batch_size)
        callbacks = ([hvdx.callbacks.BroadcastGlobalVariablesCallback(0)] if fresh else []) + [
            hvdx.callbacks.SwitchCommunication(config.switch_epoch, "hierarchical"),
            hvd_callbacks.MetricAverageCallback(),  # validation metrics: the mean over ranks
            log, Checkpoint(config.out, topo.rank, history, checkpoint)]
        fresh = False
        say(f"phase {index}: epochs {epoch}-{end - 1} at {phase.resolution} px, batch {phase.batch_size} per rank "
            f"({phase.batch_size * topo.size} global), {steps[index]} steps per epoch", flush=True)
        model.fit(train_ds, steps_per_epoch=steps[index], initial_epoch=epoch, epochs=end,
                  validation_data=val_ds, validation_steps=val_steps,
                  verbose=config.verbose if topo.rank == 0 else 0, callbacks=callbacks)
        epoch = end

    summary = summarize(config, history, topo, model, time.perf_counter() - start_wall)
    if topo.rank == 0:
        write_json(os.path.join(config.out, "summary.json"), summary)
        print_summary(config, summary)
        if config.plot:
            plot_curves(history, config, os.path.join(config.out, "curves.png"))
    # (returned, not written: the tests compare runs; batch-norm's moving statistics are each
    # rank's own, the trainable weights the same on every rank)
    summary["weights"] = model.get_weights()
    summary["trainable_weights"] = [v.numpy() for v in model.trainable_variables]
    for cache in (train_cache, val_cache):
        if cache is not None:
            cache.close()
    hvdx.barrier()
    return summary


def comm_time(strategy, d: int, rank: int, rounds: int = 12) -> float:
    """Median seconds of one aggregation of a d-element buffer (every rank calls)."""
    buffer = tf.random.stateless_normal([d], seed=[rank, 0])
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        strategy(buffer, name="dawnbench_comm_timing")
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:])


def single_rank_throughput(config: Config, steps: int, rank: int) -> Dict[str, float]:
    """The 1-rank throughput of Table 4's SE, per phase (keyed by str(phase)): samples/s of one
    rank training `steps` steps of the phase's model, resolution and batch alone, with the
    inner LARS and no communication, on a fixed synthetic batch (no input pipeline), after
    one untimed step. Every rank measures at the same time (as each GPU of a cluster would
    train alone); the slowest rank's time counts. Collective: every rank calls it."""
    import horovod.tensorflow as hvd

    from hvdx.optimizers import LARS

    model = build_model(config)
    model.compile(optimizer=LARS(learning_rate=1e-4, momentum=config.momentum, weight_decay=config.weight_decay,
                                 eeta=config.eeta, exclude_from_weight_decay=NO_DECAY, min_trust_ratio=None,
                                 max_trust_ratio=config.max_trust_ratio, parallel="pto"),
                  loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True,
                                                               label_smoothing=config.label_smoothing))
    train = model.make_train_function()
    out: Dict[str, float] = {}
    for i, phase in enumerate(dict.fromkeys(config.phases)):
        res, batch = phase.resolution, phase.batch_size
        x = tf.random.stateless_uniform([batch, res, res, 3], [rank, i], -1.0, 1.0)
        y = tf.one_hot(tf.random.stateless_uniform([batch], [rank, i + 1], 0, config.num_classes, tf.int32),
                       config.num_classes)
        batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
        float(train(batches)["loss"])  # traced at this shape
        hvd.allreduce(tf.constant(0.0), name=f"dawnbench.se.start.{i}")  # start together
        start = time.perf_counter()
        for _ in range(steps):
            logs = train(batches)
        float(logs["loss"])
        seconds = float(hvd.allreduce(tf.constant(time.perf_counter() - start, tf.float64), op=hvd.Max,
                                      name=f"dawnbench.se.{i}"))
        out[str(phase)] = batch * steps / seconds
    return out


def load_baseline(path: str) -> Dict[str, float]:
    """The 1-rank throughput per phase from a 1-rank run's summary.json (`--baseline-json`).

    Raises:
        ValueError: the run had more than one rank (its throughput is not a single rank's).
    """
    with open(path) as f:
        summary = json.load(f)
    if summary.get("ranks") != 1:
        raise ValueError(f"--baseline-json {path}: that run had {summary.get('ranks')} ranks; give the summary.json "
                         f"of a 1-rank run of the same phases (python examples/dawnbench.py ... without horovodrun)")
    return {p["phase"]: p["samples_per_s"] for p in summary["phases"]}


def scaling_efficiency(phases: List[dict], size: int, single: Dict[str, float], source: str) -> None:
    """Adds Table 4's SE to each phase row that `single` (1-rank samples/s by phase) covers:
    SE = samples/s on `size` ranks / (size x 1-rank samples/s)."""
    for p in phases:
        if p["phase"] in single:
            p.update(single_samples_per_s=single[p["phase"]], se_source=source,
                     scaling_efficiency=p["samples_per_s"] / (size * single[p["phase"]]))


def summarize(config: Config, history: List[dict], topo, model, wall: float) -> dict:
    """Per phase: strategy, samples/s (median over its epochs after the first, whose step
    is traced), steps; the final metrics; the time to the target; the communication share
    of a step per strategy (its aggregation of the model's gradient buffer alone, timed in
    this run, over the median step time); the scaling efficiency (Table 4) per phase, from
    `--baseline-json` or `--se-steps` (`single_rank_throughput`). Collective."""
    import hvdx

    metric, goal = config.target
    reached = next((h for h in history if h.get(metric, -1) >= goal), None)
    phases = []
    for index, phase in enumerate(config.phases):
        rows = [h for h in history if h["phase"] == index]
        if not rows:
            continue
        timed = rows[1:] or rows
        phases.append(dict(phase=str(phase), epochs=[r["epoch"] for r in rows],
                           communication=sorted({r["communication"] for r in rows}),
                           samples_per_s=statistics.median(r["samples_per_s"] for r in timed),
                           step_s=statistics.median(r.get("step_s", r["seconds"] / r["steps"]) for r in timed)))
    comm = {}
    if config.comm_timing:
        d = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        for name, strategy in (("HiTopK", hvdx.comm.HiTopK(density=config.density)),
                               ("Hierarchical", hvdx.comm.Hierarchical())):
            comm[name] = comm_time(strategy, d, topo.rank)
        for p in phases:
            p["comm_share"] = {c: comm[c] / p["step_s"] for c in p["communication"] if c in comm}
    if config.baseline_json:
        scaling_efficiency(phases, topo.size, load_baseline(config.baseline_json), config.baseline_json)
    elif config.se_steps > 0 and phases:
        scaling_efficiency(phases, topo.size, single_rank_throughput(config, config.se_steps, topo.rank),
                           f"{config.se_steps} steps per phase on each rank alone")
    last = history[-1] if history else {}
    return dict(ranks=topo.size, nodes=topo.num_nodes, epochs=len(history), wall_s=wall,
                trained_s=last.get("elapsed"), target={metric: goal},
                reached=None if reached is None else dict(epoch=reached["epoch"], elapsed_s=reached["elapsed"],
                                                          value=reached[metric]),
                final={k: last[k] for k in ("top1", "top5", "val_top1", "val_top5", "loss") if k in last},
                phases=phases, comm_s=comm, history=history)


def print_summary(config: Config, s: dict) -> None:
    print(f"\nper phase ({s['nodes']} nodes x {s['ranks'] // s['nodes']} ranks; as shi2021 Table 4):", flush=True)
    print(f"  {'phase':>12} {'epochs':>7} {'strategy':>22} {'samples/s':>10} {'step ms':>8} {'comm share':>11} "
          f"{'1 rank':>10} {'SE':>5}")
    for p in s["phases"]:
        share = ", ".join(f"{v:.0%}" for v in p.get("comm_share", {}).values()) or "-"
        single = f"{p['single_samples_per_s']:>10.1f} {p['scaling_efficiency']:>5.0%}" \
            if "scaling_efficiency" in p else f"{'-':>10} {'-':>5}"
        print(f"  {p['phase']:>12} {len(p['epochs']):>7} {'+'.join(p['communication']):>22} "
              f"{p['samples_per_s']:>10.1f} {p['step_s'] * 1e3:>8.1f} {share:>11} {single}")
    sources = {p["se_source"] for p in s["phases"] if "se_source" in p}
    if sources:
        print(f"  (SE = samples/s / ({s['ranks']} x 1 rank's); 1 rank's from {', '.join(sorted(sources))})")
    final = ", ".join(f"{k} {v:.4f}" for k, v in s["final"].items())
    print(f"after {s['epochs']} epochs: {final}", flush=True)
    (metric, goal), = s["target"].items()
    if s["reached"]:
        print(f"target {metric} >= {goal} reached in epoch {s['reached']['epoch'] + 1} after "
              f"{s['reached']['elapsed_s']:.1f} s of training", flush=True)
    else:
        print(f"target {metric} >= {goal} NOT reached", flush=True)
    print(f"wall time {s['wall_s']:.1f} s (this process; training {s['trained_s'] or 0:.1f} s over all runs); "
          f"summary, history and curves in {config.out}", flush=True)


def plot_curves(history: List[dict], config: Config, path: str) -> None:
    """Loss and top-1 / top-5 (train and validation) per epoch, phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] + 1 for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["loss"] for h in history], "o-", label="train")
    if "val_loss" in history[0]:
        ax_loss.plot(epochs, [h["val_loss"] for h in history], "o-", label="validation")
    for key in ("top1", "top5", "val_top1", "val_top5"):
        if key in history[0]:
            ax_acc.plot(epochs, [h[key] for h in history], "o-", label=key)
    for ax in (ax_loss, ax_acc):
        for i, phase in enumerate(config.phases):
            start = config.phase_start(i)
            ax.axvspan(start + 0.5, start + phase.epochs + 0.5, alpha=0.08 * (1 + i % 2), color="grey")
        ax.axvline(config.switch_epoch + 0.5, color="red", ls="--", lw=1, label="HiTopK -> 2DTAR")
        ax.set_xlabel("epoch")
        ax.legend()
    ax_loss.set_ylabel("loss")
    ax_loss.set_yscale("log")
    ax_acc.set_ylabel("accuracy")
    fig.suptitle(f"DAWNBench recipe: {', '.join(map(str, config.phases))}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    return train(make_config(argv))


if __name__ == "__main__":
    main()
