"""hvdx.zoo: each builder makes the architecture its contract names (layer types, output
shapes, parameter counts worked out by hand), and one seed gives one set of initial weights."""
import numpy as np
import pytest
import tensorflow as tf

from hvdx import zoo
from tests import harness

# Parameter counts by hand: a Dense is in * out + out; a Conv2D k * k * in * out (+ out with
# a bias); a BatchNormalization 4 * channels (2 of them trainable); a LayerNormalization 2 * width.
CASES = {
    # 64 * 32 + 32 + 32 * 10 + 10: the digits MLP of the training-path checks
    "mlp digits": (lambda seed: zoo.mlp(64, (32,), seed=seed), 2410),
    # 3 * 4 + 4 + 4 * 1 + 1, linear
    "mlp linear": (lambda seed: zoo.mlp(3, (4,), 1, activation=None, seed=seed), 21),
    # 80 + 1168 (two 3x3 convolutions) + 12 * 12 * 16 * 32 + 32 + 32 * 10 + 10: Horovod's MNIST CNN, narrowed
    "cnn flatten": (lambda seed: zoo.cnn((28, 28, 1), (8, 16), pool_after=(1,), dropout=0.25, head="flatten",
                                         dense=(32,), dense_dropout=0.5, output_activation="softmax", seed=seed),
                    75338),
    # 3*3*3*16 + 16, 3*3*16*32 + 32, 3*3*32*64 + 64, 64 * 10 + 10
    "cnn strided": (lambda seed: zoo.cnn((32, 32, 3), (16, 32, 64), strides=2, rescale=1 / 255.0, seed=seed), 24234),
    # stem 144 + 64; two blocks of 2 x (2304 + 64); 16 * 10 + 10
    "resnet one stage": (lambda seed: zoo.resnet((16,), input_shape=(8, 8, 1), blocks_per_stage=2, seed=seed), 9850),
    # stem 216 + 32; stage 0: 2 x (576 + 32); stage 1: 1152 + 64, 2304 + 64, projection 128 + 64; 170
    "resnet two stages": (lambda seed: zoo.resnet((8, 16), seed=seed), 5410),
    # embedding 32000; block: LN 64, attention 3 x (32*32 + 32) + 32*32 + 32, LN 64, 32*128 + 128,
    # 128*32 + 32; LN 64; 32 * 1000 + 1000
    "transformer": (lambda seed: zoo.transformer(1000, 32, 1, 2, 16, seed=seed), 77768),
    # Keras' ResNet-50 without top (23,587,712) + 2048 * 10 + 10
    "resnet50": (lambda seed: zoo.resnet50(10, seed=seed), 23_608_202),
    # Keras' VGG-19 convolutions (20,024,384) + 512 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    "vgg19": (lambda seed: zoo.vgg19(10, input_shape=(32, 32, 3), seed=seed), 38_947_914),
}


def bits(model):
    return [np.asarray(w).tobytes() for w in model.get_weights()]


@pytest.mark.parametrize("case", list(CASES))
def test_a_seed_gives_the_same_initial_weights_and_another_seed_others(case):
    build, count = CASES[case]
    first, again, other = build(3), build(3), build(4)
    assert first.count_params() == count
    assert bits(first) == bits(again)
    assert bits(first) != bits(other)


def test_without_a_seed_the_global_random_state_decides():
    tf.keras.utils.set_random_seed(7)
    a = zoo.mlp(8, (4,))
    b = zoo.mlp(8, (4,))
    assert bits(a) != bits(b)
    tf.keras.utils.set_random_seed(7)
    assert bits(zoo.mlp(8, (4,))) == bits(a)


def out_shape(layer) -> tuple:
    """A layer's (or model's) output shape as a tuple, under either Keras."""
    outputs = getattr(layer, "outputs", None)  # a model's (Keras 3's Sequential has no .output until called)
    return tuple((outputs[0] if outputs else layer.output).shape)


def weight_name(weight) -> str:
    """A weight's name with its layer's ("stem_bn/gamma"): Keras 3's path, Keras 2's name."""
    return getattr(weight, "path", weight.name)


def types(model):
    return [type(layer).__name__ for layer in model.layers]


def test_mlp_is_dense_layers_of_the_widths_with_their_activations():
    model = zoo.mlp(64, (8, 600), seed=0, name="digits")
    assert isinstance(model, tf.keras.Sequential) and model.name == "digits"
    assert types(model) == ["Dense", "Dense", "Dense"]
    assert [w.shape for w in model.weights] == [(64, 8), (8,), (8, 600), (600,), (600, 10), (10,)]
    assert [layer.activation.__name__ for layer in model.layers] == ["relu", "relu", "linear"]
    assert out_shape(model) == (None, 10)
    soft = zoo.mlp(1024, (16, 16), output_activation="softmax", seed=0)
    assert soft.layers[-1].activation.__name__ == "softmax" and tuple(soft.inputs[0].shape) == (None, 1024)
    tanh = zoo.mlp(6, (8,), 3, activation="tanh", seed=0)
    assert [layer.activation.__name__ for layer in tanh.layers] == ["tanh", "linear"]
    assert types(zoo.mlp(8, (), 4, seed=0)) == ["Dense"]  # a linear model


def test_mlp_follows_the_global_dtype_policy():
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = zoo.mlp(64, (32,), seed=0)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    assert {layer.compute_dtype for layer in model.layers} == {"float16"}
    assert {tf.as_dtype(w.dtype) for w in model.weights} == {tf.float32}


def test_cnn_stacks_convolutions_pools_dropouts_and_its_head_in_order():
    model = zoo.cnn((28, 28, 1), (8, 16), pool_after=(1,), dropout=0.25, head="flatten", dense=(32,),
                    dense_dropout=0.5, output_activation="softmax", seed=0)
    assert types(model) == ["Conv2D", "Conv2D", "MaxPooling2D", "Dropout", "Flatten", "Dense", "Dropout", "Dense"]
    assert [out_shape(layer) for layer in model.layers[:5]] == [
        (None, 26, 26, 8), (None, 24, 24, 16), (None, 12, 12, 16), (None, 12, 12, 16), (None, 2304)]
    assert [layer.rate for layer in model.layers if isinstance(layer, tf.keras.layers.Dropout)] == [0.25, 0.5]
    assert model.layers[-1].activation.__name__ == "softmax"

    strided = zoo.cnn((32, 32, 3), (16, 32, 64), strides=2, rescale=1 / 255.0, seed=0)
    assert types(strided) == ["Rescaling", "Conv2D", "Conv2D", "Conv2D", "GlobalAveragePooling2D", "Dense"]
    assert [out_shape(layer)[1] for layer in strided.layers[1:4]] == [15, 7, 3]  # "valid" padding, stride 2

    any_size = zoo.cnn((None, None, 3), (8, 16), strides=(1, 2), padding="same", name="tiny_cnn", seed=0)
    assert any_size.name == "tiny_cnn" and [c.strides for c in any_size.layers[:2]] == [(1, 1), (2, 2)]
    assert any_size(np.zeros((2, 16, 16, 3), np.float32)).shape == (2, 10)
    assert any_size.layers[1](np.zeros((1, 16, 16, 8), np.float32)).shape == (1, 8, 8, 16)


def test_cnn_refuses_an_unknown_head_and_strides_that_do_not_match():
    with pytest.raises(ValueError, match="'average'"):
        zoo.cnn((8, 8, 1), (4,), head="max")
    with pytest.raises(ValueError, match="one per convolution"):
        zoo.cnn((8, 8, 1), (4, 8), strides=(1, 2, 2))


def test_resnet_is_stages_of_basic_blocks_with_projections_where_the_shape_changes():
    model = zoo.resnet((8, 16, 32), input_shape=(32, 32, 3), blocks_per_stage=2, bn_momentum=0.9, seed=0)
    layers = {layer.name: layer for layer in model.layers}
    assert sum(isinstance(layer, tf.keras.layers.BatchNormalization) for layer in model.layers) == 1 + 3 * 4 + 2
    assert sum(isinstance(layer, tf.keras.layers.Add) for layer in model.layers) == 6
    assert {layer.momentum for layer in model.layers if isinstance(layer, tf.keras.layers.BatchNormalization)} == {0.9}
    assert not any(layer.use_bias for layer in model.layers if isinstance(layer, tf.keras.layers.Conv2D))
    assert set(n for n in layers if n.endswith("_proj_conv")) == {"stage1_block0_proj_conv", "stage2_block0_proj_conv"}
    assert layers["stage1_block0_a_conv"].strides == (2, 2) and layers["stage1_block1_a_conv"].strides == (1, 1)
    assert layers["stage1_block0_proj_conv"].kernel_size == (1, 1)
    assert [out_shape(layers[f"stage{s}_block1_out"]) for s in range(3)] == [
        (None, 32, 32, 8), (None, 16, 16, 16), (None, 8, 8, 32)]
    assert out_shape(model) == (None, 10)


def test_resnet_names_its_layers_or_leaves_keras_names():
    named = zoo.resnet((8, 16), 5, name="small_resnet", seed=0)
    assert named.name == "small_resnet"
    assert [layer.name for layer in named.layers[1:4]] == ["stem_conv", "stem_bn", "stem_relu"]
    assert {"stage1_proj_conv", "stage1_proj_bn", "stage1_add", "stage1_out", "pool", "logits"} <= {
        layer.name for layer in named.layers}
    assert any(weight_name(w).startswith("stem_bn/") for w in named.weights)
    plain = zoo.resnet((8, 16), 5, layer_names=False, seed=0)
    assert not {"stem_conv", "logits"} & {layer.name for layer in plain.layers}
    assert any("batch_normalization" in weight_name(w) for w in plain.weights)
    assert bits(named) == bits(plain)  # the names change nothing else


def test_resnet_shortcut_order_changes_the_weights_order_not_the_function():
    first = zoo.resnet((8, 16), seed=0)
    last = zoo.resnet((8, 16), shortcut_first=False, seed=0)
    assert [weight_name(w) for w in first.weights] != [weight_name(w) for w in last.weights]
    assert sorted(zip([weight_name(w) for w in first.weights], bits(first))) == \
        sorted(zip([weight_name(w) for w in last.weights], bits(last)))
    x = np.random.default_rng(0).standard_normal((2, 12, 12, 3)).astype(np.float32)
    np.testing.assert_array_equal(first(x).numpy(), last(x).numpy())


def test_resnets_logits_are_float32_under_mixed_precision():
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = zoo.resnet((8,), seed=0)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    assert model.get_layer("stem_conv").compute_dtype == "float16"
    assert model.get_layer("logits").compute_dtype == "float32" and model.output.dtype == tf.float32


def test_resnet50_and_vgg19_put_their_heads_on_keras_bases():
    resnet = zoo.resnet50(10, seed=0)
    assert resnet.name == "resnet50" and resnet.input_shape == (None, None, None, 3)
    assert resnet.layers[-1].name == "logits" and resnet.layers[-2].name == "avg_pool"
    vgg = zoo.vgg19(10, input_shape=(32, 32, 3), seed=0)
    assert vgg.name == "vgg19" and types(vgg)[-4:] == ["Flatten", "Dense", "Dense", "Dense"]
    assert [layer.units for layer in vgg.layers[-3:]] == [4096, 4096, 10]


def test_transformer_maps_token_sentences_to_logits_per_position():
    model = zoo.transformer(1000, 32, 2, 4, 16, seed=0)
    assert model.input.dtype == tf.int32 and model.input_shape == (None, 16)
    assert out_shape(model) == (None, 16, 1000)
    assert types(model).count("MultiHeadAttention") == 2 and types(model).count("LayerNormalization") == 5
    attention = next(layer for layer in model.layers if isinstance(layer, tf.keras.layers.MultiHeadAttention))
    assert attention.get_config()["num_heads"] == 4 and attention.get_config()["key_dim"] == 8
    assert [layer.units for layer in model.layers if isinstance(layer, tf.keras.layers.Dense)][:2] == [128, 32]


@harness.KERAS3
def test_keras3_builds_the_same_architectures():
    """`keras=keras` (Keras 3, the benchmarks' --keras 3): the same layers in the same order
    with the same parameter counts as Keras 2's models."""
    import keras

    import tf_keras

    builders = {
        "mlp": lambda k: zoo.mlp(64, (32,), seed=0, keras=k),
        "cnn": lambda k: zoo.cnn((12, 12, 1), (4, 8), pool_after=(1,), head="average", seed=0, keras=k),
        "resnet": lambda k: zoo.resnet((4, 8), input_shape=(8, 8, 3), seed=0, keras=k),
        "transformer": lambda k: zoo.transformer(50, 16, 1, 2, 8, seed=0, keras=k),
        "vgg19": lambda k: zoo.vgg19(10, input_shape=(32, 32, 3), seed=0, keras=k),
    }
    for name, build in builders.items():
        model2, model3 = build(tf_keras), build(keras)
        assert isinstance(model3, keras.Model), name
        assert model3.count_params() == model2.count_params() > 0, name
        # (Keras 2 lists the transformer's residual additions as TFOpLambda layers; Keras 3 does not)
        assert [type(layer).__name__ for layer in model3.layers] == [
            type(layer).__name__ for layer in model2.layers if type(layer).__name__ != "TFOpLambda"], name


def test_the_builders_default_to_tf_keras_as_tensorflow_makes_it():
    """keras=None is tf.keras, whatever TensorFlow makes it (Keras 3 on 2.16+ by default, Keras
    2 in this suite's process): a model and a tf.keras optimizer are of one Keras."""
    model = zoo.mlp(8, (4,), seed=0)
    assert isinstance(model, tf.keras.Model)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
