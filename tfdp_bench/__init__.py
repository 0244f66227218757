"""Benchmarks: tfdp vs ``tf.distribute.MirroredStrategy``, side by side in one process.

Every benchmark builds all its contenders in the same process, warms each one up (traces it), then
runs rounds in which every contender runs once, in alternating order (forward, then reversed), so
slow drifts of the machine hit all contenders alike. Reported figures are medians over the rounds
and ratios of medians; nothing here asserts on timings.

* :func:`run_allreduce` (``tfdp bench allreduce``): one replica-context ``all_reduce`` of a
  gradient set (ResNet50's, a deep narrow MLP's, or single tensors of given sizes).
* :func:`run_fit` (``tfdp bench fit``): Keras ``model.fit`` throughput of a deep narrow MLP.

Both return plain dicts (JSON-serialisable) and take ``cpu_replicas``: the host CPU is split into
that many logical devices first, so call them before anything else starts TensorFlow (or after
``tfdp.configure_cpu_replicas`` with the same count).

Layout: one module per ``tfdp bench`` command (``allreduce``, ``fit``, ``patterns``, ``workers``,
``input``, ``sparse``, ``scaling``, ``gpu``), each with ``build_parser()``, ``parse_args(argv)``
and ``run(args)``; ``cli`` lists and dispatches them; ``parser`` is the one argument parser and
the shared option checks; ``_common`` the shared measurement helpers; ``trace`` the profiler step
timeline of ``tfdp bench fit --trace``. Nothing here starts TensorFlow at import.
"""

__all__ = ["run_allreduce", "run_fit", "format_allreduce", "format_fit"]


def __getattr__(name):  # lazy: importing tfdp_bench must not start TensorFlow
    if name in ("run_allreduce", "format_allreduce"):
        from tfdp_bench import allreduce
        return getattr(allreduce, name)
    if name in ("run_fit", "format_fit"):
        from tfdp_bench import fit
        return getattr(fit, name)
    raise AttributeError(f"module 'tfdp_bench' has no attribute {name!r}")
