"""The Keras train-step path: where tfdp acts inside Keras so that N replicas train as one device.

* ``gradient_path.py``: each replica's Keras loss carries its share of the global batch; the
  outermost ``optimizer.apply`` reduces the gradients on entry (clipping, loss-scale checks and
  updates then see the global gradient); per-replica XLA for ``jit_compile=True`` on CPU
  replicas; the symbolic build from the dataset's element spec. Installed by the strategies
  (``tfdp.strategy.extended``); every Keras internal it touches is listed in ``tfdp.compat``.
"""
