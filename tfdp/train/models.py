"""Model builders for ``tfdp train``: ``[model] kind`` -> a compiled-ready Keras model.

* ``cnn``: two 3x3 convolutions, max-pool, dense (digits, CIFAR-sized images).
* ``resnet``: ResNet v1 for CIFAR (He et al. 2016, depth 6n+2: 8, 20, 56, ...), BatchNorm.
* ``bert``: a BERT-style encoder (token + learned position embeddings, post-LayerNorm
  transformer blocks) with a masked-LM head over the vocabulary.
* ``dlrm``: DLRM-style recommender: user / item embedding tables (sparse gradients), bottom MLP
  on dense features, pairwise dot-product interactions, top MLP, click probability.

Each builder returns ``(model, loss, metrics, weighted_metrics)``.
"""

from __future__ import annotations

import keras
from keras import layers, ops


def build(model_cfg: dict, info: dict):
    kind = model_cfg["kind"]
    return _BUILDERS[kind](model_cfg, info)


def _classifier_head(num_classes):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return loss, [keras.metrics.SparseCategoricalAccuracy(name="accuracy")], None


def cnn(cfg, info):
    f, units = cfg["filters"], cfg["dense_units"]
    model = keras.Sequential([
        keras.Input(info["image_shape"]),
        layers.Conv2D(f, 3, padding="same", activation="relu"),
        layers.Conv2D(f, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Flatten(),
        layers.Dense(units, activation="relu"),
        layers.Dense(info["num_classes"]),
    ], name="cnn")
    return (model, *_classifier_head(info["num_classes"]))


def _conv_bn(x, filters, kernel, strides=1, relu=True):
    x = layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False,
                      kernel_initializer="he_normal",
                      kernel_regularizer=None)(x)
    x = layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)
    return layers.ReLU()(x) if relu else x


def resnet(cfg, info):
    depth, width = cfg["depth"], cfg["width"]
    if (depth - 2) % 6:
        from tfdp.errors import UsageError, message
        raise UsageError(message("Invalid model.depth", f"model.depth={depth}",
                                 "A CIFAR ResNet has depth 6n+2: 8, 14, 20, 32, 44, 56, 110."))
    blocks = (depth - 2) // 6
    inputs = keras.Input(info["image_shape"])
    x = _conv_bn(inputs, width, 3)
    for stage in range(3):
        filters = width * 2 ** stage
        for b in range(blocks):
            strides = 2 if stage > 0 and b == 0 else 1
            y = _conv_bn(x, filters, 3, strides)
            y = _conv_bn(y, filters, 3, relu=False)
            shortcut = x
            if strides != 1 or x.shape[-1] != filters:
                shortcut = _conv_bn(x, filters, 1, strides, relu=False)
            x = layers.ReLU()(layers.Add()([y, shortcut]))
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(info["num_classes"])(x)
    model = keras.Model(inputs, outputs, name=f"resnet{depth}")
    return (model, *_classifier_head(info["num_classes"]))


class PositionEmbedding(layers.Layer):
    """Adds a learned vector per position to a (batch, seq, hidden) input."""

    def __init__(self, seq_len, hidden, **kwargs):
        super().__init__(**kwargs)
        self.seq_len, self.hidden = seq_len, hidden

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.seq_len, self.hidden), name="table",
                                     initializer=keras.initializers.TruncatedNormal(stddev=0.02))

    def call(self, x):
        return x + ops.expand_dims(self.table[: ops.shape(x)[1]], 0)

    def get_config(self):
        return {**super().get_config(), "seq_len": self.seq_len, "hidden": self.hidden}


def bert(cfg, info):
    vocab, seq_len = info["vocab_size"], info["seq_len"]
    hidden, heads = cfg["hidden"], cfg["heads"]
    if hidden % heads:
        from tfdp.errors import UsageError, message
        raise UsageError(message("model.hidden must be a multiple of model.heads",
                                 f"model.hidden={hidden}, model.heads={heads}",
                                 "Pick e.g. hidden = 64 with heads = 2 or 4."))
    init = keras.initializers.TruncatedNormal(stddev=0.02)
    ids = keras.Input((seq_len,), dtype="int32", name="token_ids")
    x = layers.Embedding(vocab, hidden, embeddings_initializer=init, name="token_embedding")(ids)
    x = PositionEmbedding(seq_len, hidden, name="position_embedding")(x)
    x = layers.LayerNormalization(epsilon=1e-12)(x)
    drop = cfg["dropout"]
    for i in range(cfg["layers"]):
        attn = layers.MultiHeadAttention(heads, hidden // heads, dropout=drop,
                                         kernel_initializer=init, name=f"attention_{i}")(x, x)
        x = layers.LayerNormalization(epsilon=1e-12)(x + layers.Dropout(drop)(attn))
        ff = layers.Dense(cfg["intermediate"], activation="gelu", kernel_initializer=init)(x)
        ff = layers.Dense(hidden, kernel_initializer=init)(ff)
        x = layers.LayerNormalization(epsilon=1e-12)(x + layers.Dropout(drop)(ff))
    x = layers.Dense(hidden, activation="gelu", kernel_initializer=init)(x)
    x = layers.LayerNormalization(epsilon=1e-12)(x)
    logits = layers.Dense(vocab, kernel_initializer=init, name="mlm_logits")(x)
    model = keras.Model(ids, logits, name="bert_mlm")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # labels/weights cover every position; weight 1 only where a token was masked
    return model, loss, None, [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def dlrm(cfg, info):
    d = cfg["embedding_dim"]
    user = keras.Input((), dtype="int64", name="user_id")
    item = keras.Input((), dtype="int64", name="item_id")
    history = keras.Input((info["history_len"],), dtype="int64", name="history")
    dense = keras.Input((info["dense_dim"],), name="dense_features")
    user_table = layers.Embedding(info["num_users"], d, name="user_embedding")
    item_table = layers.Embedding(info["num_items"], d, name="item_embedding")
    u = user_table(user)
    i = item_table(item)
    h = ops.mean(item_table(history), axis=1)
    z = dense
    for units in cfg["bottom_units"]:
        z = layers.Dense(units, activation="relu")(z)
    z = layers.Dense(d, activation="relu")(z)
    feats = ops.stack([u, i, h, z], axis=1)                       # (batch, 4, d)
    dots = ops.einsum("bnd,bmd->bnm", feats, feats)               # pairwise interactions
    iu = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    pairs = ops.stack([dots[:, a, b] for a, b in iu], axis=1)      # (batch, 6)
    x = layers.Concatenate()([z, pairs])
    for units in cfg["top_units"]:
        x = layers.Dense(units, activation="relu")(x)
    out = layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model({"user_id": user, "item_id": item, "history": history,
                         "dense_features": dense},
                        out, name="dlrm")
    metrics = [keras.metrics.BinaryAccuracy(name="accuracy"), keras.metrics.AUC(name="auc")]
    return model, keras.losses.BinaryCrossentropy(), metrics, None


_BUILDERS = {"cnn": cnn, "resnet": resnet, "bert": bert, "dlrm": dlrm}


def embedding_variables(model) -> set:
    """ids of the variables of every Embedding layer (their gradients are IndexedSlices)."""
    out = set()
    stack = [model]
    seen = set()
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if isinstance(layer, layers.Embedding):
            out.update(id(v) for v in layer.trainable_variables)
        stack.extend(getattr(layer, "layers", []) or [])
        stack.extend(getattr(layer, "_layers", []) or [])
    return out
