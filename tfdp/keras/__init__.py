"""The Keras train-step path: where tfdp acts inside Keras so that N replicas train as one device.

* ``step.py``: the ``Step`` of one ``strategy.run`` (replica shares, empty replicas) and where
  the calling replica stands in it.
* ``losses.py``: what a replica's loss is worth: one device's semantics for every divisor Keras
  uses (examples, valid elements under a mask, the sum of sample weights, scalars), for the
  gradient and for the values users read.
* ``gradient_path.py``: the outermost ``optimizer.apply`` reduces the gradients on entry
  (clipping, loss-scale checks and updates then see the global gradient); per-replica XLA for ``jit_compile=True`` on CPU
  replicas; the symbolic build from the dataset's element spec. Installed by the strategies
  (``tfdp.strategy.extended``); every Keras internal it touches is listed in ``tfdp.compat``.
"""
