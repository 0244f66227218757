"""Custom training loops (strategy.run / reduce / compute_average_loss / Checkpoint)."""

import numpy as np
import tensorflow as tf
import keras

import tfdp
from helpers import TOL, dense_embedding_model, make_data, max_diff

GLOBAL_BATCH = 48


def _train(strategy, x, y, steps_before=None, ckpt_dir=None, restore_from=None, epochs=2):
    """A hand-written loop; with strategy=None it runs on one device, no tf.distribute."""
    ctx = strategy.scope() if strategy else _null()
    with ctx:
        model = dense_embedding_model()
        opt = keras.optimizers.SGD(0.05, momentum=0.9)
        opt.build(model.trainable_variables)
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    if restore_from:
        ckpt.restore(restore_from).assert_existing_objects_matched()

    def step_fn(inputs, labels):
        with tf.GradientTape() as tape:
            pred = model(inputs, training=True)
            per_example = tf.reduce_mean(tf.square(pred - labels), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    if strategy:
        ds = strategy.experimental_distribute_dataset(ds)

        @tf.function
        def train_step(a, b):
            per_replica = strategy.run(step_fn, args=(a, b))
            return strategy.reduce("SUM", per_replica, axis=None)
    else:
        train_step = tf.function(step_fn)

    losses, saved = [], None
    done = 0
    for _ in range(epochs):
        for a, b in ds:
            losses.append(float(train_step(a, b)))
            done += 1
            if steps_before is not None and done == steps_before:
                saved = ckpt.save(ckpt_dir)
    return model, losses, saved


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_custom_loop_equals_single_device():
    x, y = make_data(192, seed=11)
    ref, ref_losses, _ = _train(None, x, y)
    s = tfdp.DataParallelStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    m, losses, _ = _train(s, x, y)
    assert len(losses) == len(ref_losses) == 8
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_diff(ref.get_weights(), m.get_weights()) <= TOL
    for v in m.trainable_variables:
        copies = s.experimental_local_results(v.value)
        for c in copies[1:]:
            np.testing.assert_array_equal(np.asarray(c), np.asarray(copies[0]))


def test_checkpoint_save_restore_under_strategy(tmp_path):
    x, y = make_data(192, seed=12)
    s = tfdp.DataParallelStrategy(["CPU:0", "CPU:1"])
    full, _, saved = _train(s, x, y, steps_before=4, ckpt_dir=str(tmp_path / "ckpt"))
    assert saved
    # restore the mid-run checkpoint into a fresh model on a different replica count
    s4 = tfdp.DataParallelStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    resumed, _, _ = _train(s4, x, y, restore_from=saved, epochs=1)  # 4 more steps
    assert max_diff(full.get_weights(), resumed.get_weights()) <= TOL
