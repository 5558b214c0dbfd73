"""The models hvdx's benchmarks, tests and examples train: one builder per family, TensorFlow
only (no hvdx module).

    from hvdx.zoo import mlp, resnet
    model = mlp(64, (32,), seed=0)                               # the digits MLP: 64-32-10
    model = resnet((32, 64, 128), blocks_per_stage=2, input_shape=(32, 32, 3))

Every builder takes `seed`: an int reseeds Python, NumPy and TensorFlow
(the Keras' `utils.set_random_seed`) before the first layer, so one seed gives the same
initial weights in every process (what data-parallel ranks start from); None (the default)
builds from the global random state as it is. Keras' layer names are its automatic ones
(`dense`, `dense_1`, ...) unless a builder says otherwise; layers take the global dtype
policy, except that the ResNets' logits are float32 under any policy (mixed precision's
recipe).

The builders use tf.keras as TensorFlow makes it (Keras 3 from TensorFlow 2.16 on, Keras 2 with
`TF_USE_LEGACY_KERAS=1` and on 2.15), so that the model and a `tf.keras.optimizers` optimizer
are of one Keras; each takes `keras=`, the Keras module whose layers it uses, e.g. `keras=keras`
(Keras 3, `import keras`) or `keras=tf_keras` (Keras 2) builds the same architecture with that
Keras (its initial weights differ: each Keras draws its own).
"""
from __future__ import annotations

from typing import Any, Collection, Optional, Sequence, Union

import tensorflow as tf

from hvdx.arguments import integer, is_integer

__all__ = ["cnn", "mlp", "resnet", "resnet50", "transformer", "vgg19"]

Shape = Sequence[Optional[int]]


def _keras(keras=None):
    """`keras`, or None: tf.keras as TensorFlow makes it."""
    return keras if keras is not None else tf.keras


def _reseed(seed: Optional[int], keras=None) -> None:
    seed = integer(seed, "seed", optional=True)
    if seed is not None:
        _keras(keras).utils.set_random_seed(seed)


def mlp(inputs: int = 64, widths: Sequence[int] = (64,), classes: int = 10, *, activation: Optional[str] = "relu",
        output_activation: Optional[str] = None, name: Optional[str] = None,
        seed: Optional[int] = None, keras=None) -> Any:
    """A fully connected network: `inputs` features -> one Dense of each of `widths` with
    `activation` -> `classes` outputs with `output_activation` (None: logits).

    Args:
      inputs: features per sample (64: the digits' 8x8 pixels).
      widths: the hidden layers' units, input side first; () is a linear model.
      classes: output units.
      activation, output_activation: Keras activations of the hidden and the output layers.
      name: the Sequential's name (None: Keras' `sequential_N`).
      seed: see the module.
      keras: the Keras module to build with (None: tf.keras as TensorFlow makes it); see the module.

    Returns:
      A built Sequential: Input, len(widths) + 1 Dense layers; inputs * w1 + w1 + ... +
      w_last * classes + classes parameters.
    """
    keras = _keras(keras)
    _reseed(seed, keras)
    layers = [keras.Input((inputs,))] + [keras.layers.Dense(w, activation=activation) for w in widths]
    return keras.Sequential(layers + [keras.layers.Dense(classes, activation=output_activation)], name=name)


def cnn(input_shape: Shape, filters: Sequence[int], classes: int = 10, *, kernel_size: int = 3,
        strides: Union[int, Sequence[int]] = 1, padding: str = "valid", activation: Optional[str] = "relu",
        pool_after: Collection[int] = (), rescale: Optional[float] = None, dropout: float = 0.0,
        head: str = "average", dense: Sequence[int] = (), dense_dropout: float = 0.0,
        output_activation: Optional[str] = None, name: Optional[str] = None,
        seed: Optional[int] = None, keras=None) -> Any:
    """A plain convolutional network, in this order: [Rescaling(rescale)], one Conv2D of each
    of `filters` (each followed by a 2x2 MaxPool2D where its index is in `pool_after`),
    [Dropout(dropout)], the head (GlobalAveragePooling2D for "average", Flatten for
    "flatten"), one Dense of each of `dense` with `activation` (each followed by
    Dropout(dense_dropout) when it is > 0), a Dense of `classes` with `output_activation`.

    Args:
      input_shape: (height, width, channels); None sizes accept any (with head="average").
      filters: each convolution's filters, input side first.
      kernel_size, padding, activation: every convolution's (activation also the hidden Dense layers').
      strides: every convolution's stride, or one per convolution.
      pool_after: indices into `filters` of the convolutions a max-pool follows.
      rescale: a Rescaling layer's scale in front (e.g. 1 / 255 for uint8 pixels); None: none.
      dropout: the rate of a Dropout after the convolutions (0: none).
      head: "average" (global average pooling) or "flatten".
      dense, dense_dropout: the hidden Dense layers' units and the rate of the Dropout after each.
      classes, output_activation, name, seed, keras: as `mlp`'s.

    Returns:
      A built Sequential.

    Raises:
      ValueError: an unknown head, or as many strides as convolutions not given.
    """
    if head not in ("average", "flatten"):
        raise ValueError(f"head={head!r}: pass 'average' (global average pooling) or 'flatten'")
    steps = [int(strides)] * len(filters) if is_integer(strides) else list(strides)
    if len(steps) != len(filters):
        raise ValueError(f"{len(steps)} strides for {len(filters)} convolutions: pass one int or one per convolution")
    keras = _keras(keras)
    _reseed(seed, keras)
    layers = keras.layers
    stack = [keras.Input(tuple(input_shape))] + ([layers.Rescaling(rescale)] if rescale is not None else [])
    for i, (f, s) in enumerate(zip(filters, steps)):
        stack.append(layers.Conv2D(f, kernel_size, strides=s, padding=padding, activation=activation))
        stack += [layers.MaxPool2D()] if i in pool_after else []
    stack += [layers.Dropout(dropout)] if dropout else []
    stack.append(layers.GlobalAveragePooling2D() if head == "average" else layers.Flatten())
    for units in dense:
        stack.append(layers.Dense(units, activation=activation))
        stack += [layers.Dropout(dense_dropout)] if dense_dropout else []
    return keras.Sequential(stack + [layers.Dense(classes, activation=output_activation)], name=name)


def resnet(widths: Sequence[int], classes: int = 10, *, input_shape: Shape = (None, None, 3),
           blocks_per_stage: int = 1, bn_momentum: float = 0.99, layer_names: bool = True,
           shortcut_first: bool = True, name: Optional[str] = None, seed: Optional[int] = None,
           keras=None) -> Any:
    """A ResNet of basic blocks (He et al., "Deep Residual Learning for Image Recognition",
    2016, arXiv:1512.03385, sec. 4.2's CIFAR networks): a 3x3 stem of widths[0] filters, then
    one stage per width of `blocks_per_stage` blocks, global average pooling, Dense logits.

    conv_bn is a bias-free Conv2D ("same" padding) and a BatchNormalization(bn_momentum). The
    stem is conv_bn + ReLU. A block is y = conv_bn(ReLU(conv_bn(x, stride)), 1); its shortcut
    is x, or conv_bn with a 1x1 kernel and the block's stride ("valid" padding) where the
    shape changes (built after y); out = ReLU(Add([shortcut, y])). The first block of every
    stage but the first has stride 2.

    Args:
      widths: each stage's filters (its length is the number of stages).
      classes: logits (float32 under any dtype policy).
      input_shape: (height, width, channels); the default takes any image size.
      blocks_per_stage: basic blocks per stage.
      bn_momentum: every BatchNormalization's momentum.
      layer_names: name the layers ("stem_conv", "stem_bn", "stem_relu"; in stage s
        "stage{s}_a_conv", "_a_bn", "_a_relu", "_b_conv", "_b_bn", "_proj_conv", "_proj_bn",
        "_add", "_out" with the prefix "stage{s}" for one block per stage, else
        "stage{s}_block{b}"; "pool", "logits"): checkpoints and weight-decay patterns such
        as "_bn/" rely on them. False: Keras' automatic names ("conv2d_3", "batch_normalization_2").
      shortcut_first: Add([shortcut, y]); False: Add([y, shortcut]). The sum is the same, but
        Keras orders the model's layers, hence `weights` (what an aggregation fuses, in
        order), by the Add's inputs.
      name: the Model's name (None: Keras' `model_N`).
      seed: see the module.
      keras: as `mlp`'s.

    Returns:
      A built functional Model.
    """
    keras = _keras(keras)
    _reseed(seed, keras)
    layers = keras.layers

    def label(text: str) -> Optional[str]:
        return text if layer_names else None

    def conv_bn(x, filters: int, size: int, stride: int, prefix: str):
        x = layers.Conv2D(filters, size, stride, "same" if size > 1 else "valid", use_bias=False,
                          name=label(f"{prefix}_conv"))(x)
        return layers.BatchNormalization(momentum=bn_momentum, name=label(f"{prefix}_bn"))(x)

    inputs = keras.Input(tuple(input_shape))
    x = layers.ReLU(name=label("stem_relu"))(conv_bn(inputs, widths[0], 3, 1, "stem"))
    for s, width in enumerate(widths):
        for b in range(blocks_per_stage):
            prefix = f"stage{s}" if blocks_per_stage == 1 else f"stage{s}_block{b}"
            stride = 2 if s and not b else 1
            y = layers.ReLU(name=label(f"{prefix}_a_relu"))(conv_bn(x, width, 3, stride, f"{prefix}_a"))
            y = conv_bn(y, width, 3, 1, f"{prefix}_b")
            if stride != 1 or x.shape[-1] != width:
                x = conv_bn(x, width, 1, stride, f"{prefix}_proj")
            pair = [x, y] if shortcut_first else [y, x]
            x = layers.ReLU(name=label(f"{prefix}_out"))(layers.Add(name=label(f"{prefix}_add"))(pair))
    x = layers.GlobalAveragePooling2D(name=label("pool"))(x)
    outputs = layers.Dense(classes, name=label("logits"), dtype="float32")(x)
    return keras.Model(inputs, outputs, name=name)


def resnet50(classes: int = 1000, *, input_shape: Shape = (None, None, 3), name: str = "resnet50",
             seed: Optional[int] = None, keras=None) -> Any:
    """Keras' ResNet-50 without weights and without its top, average-pooled, under a Dense
    "logits" layer of `classes` (float32 under any dtype policy): 23.6M + 2049 * classes
    parameters. `input_shape`'s default takes any image size; `seed`, `keras`: see the module."""
    keras = _keras(keras)
    _reseed(seed, keras)
    base = keras.applications.ResNet50(weights=None, include_top=False, input_shape=tuple(input_shape),
                                       pooling="avg")
    outputs = keras.layers.Dense(classes, name="logits", dtype="float32")(base.output)
    return keras.Model(base.input, outputs, name=name)


def vgg19(classes: int = 1000, *, input_shape: Shape = (224, 224, 3), name: str = "vgg19",
          seed: Optional[int] = None, keras=None) -> Any:
    """Keras' VGG-19 without weights and without its top, flattened, under two Dense(4096,
    ReLU) and a Dense of `classes` logits (VGG's classifier; `input_shape` fixes its first
    Dense's size, 143.7M parameters at 224 px); `seed`, `keras`: see the module."""
    keras = _keras(keras)
    _reseed(seed, keras)
    layers = keras.layers
    base = keras.applications.VGG19(weights=None, include_top=False, input_shape=tuple(input_shape))
    x = layers.Flatten()(base.output)
    x = layers.Dense(4096, activation="relu")(layers.Dense(4096, activation="relu")(x))
    return keras.Model(base.input, layers.Dense(classes)(x), name=name)


def transformer(vocabulary: int, width: int, blocks: int, heads: int, length: int, *,
                name: Optional[str] = None, seed: Optional[int] = None, keras=None) -> Any:
    """A pre-norm Transformer encoder over int32 token sentences of `length`: an Embedding
    of `vocabulary` x `width`, `blocks` blocks of h += MultiHeadAttention(heads, width //
    heads)(LN(h), LN(h)) and h += Dense(width)(Dense(4 * width, GELU)(LN(h))), then LN and
    Dense logits over the vocabulary at every position. (16000, 512, 3, 8, 64) has 25.8M
    parameters. `name`: the Model's (None: Keras' `model_N`); `seed`, `keras`: see the module."""
    keras = _keras(keras)
    _reseed(seed, keras)
    layers = keras.layers
    tokens = keras.Input((length,), dtype="int32")
    h = layers.Embedding(vocabulary, width)(tokens)
    for _ in range(blocks):
        a = layers.LayerNormalization()(h)
        h = h + layers.MultiHeadAttention(heads, width // heads)(a, a)
        f = layers.LayerNormalization()(h)
        f = layers.Dense(4 * width, activation="gelu")(f)
        h = h + layers.Dense(width)(f)
    return keras.Model(tokens, layers.Dense(vocabulary)(layers.LayerNormalization()(h)), name=name)
