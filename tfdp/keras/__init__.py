"""The Keras train-step path: where tfdp acts inside Keras so that N replicas train as one device.

* ``adapter.py``: every hook set tfdp puts into Keras (and TensorFlow, ``sys.excepthook``),
  counted by its live users (strategies, tfdp's BackupAndRestore): in Keras only while tfdp is
  in use, Keras's own functions back exactly after.
* ``step.py``: the ``StepContext`` of one ``strategy.run`` (replica shares, empty replicas, the
  step's state) and where the calling replica stands in it.
* ``losses.py``: what a replica's loss is worth: one device's semantics for every divisor Keras
  uses (examples, valid elements under a mask, the sum of sample weights, scalars), for the
  gradient and for the values users read.
* ``gradient_path.py``: the outermost ``optimizer.apply`` reduces the gradients on entry
  (clipping, loss-scale checks and updates then see the global gradient); per-replica XLA for
  ``jit_compile=True`` on CPU replicas; the symbolic build from the dataset's element spec. In Keras while a tfdp strategy
  lives (``adapter``); every Keras internal it touches is listed in ``tfdp.compat``.
"""
