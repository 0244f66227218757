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

Layout: this package (``tfdp_bench``, next to ``tfdp`` in the repository and installed with it
by setup.py) builds on tfdp; tfdp never imports it. ``tfdp bench`` reaches it through the
``tfdp.commands`` entry point ``bench = tfdp_bench.cli`` (setup.py; tfdp/cli.py lists the
group). One module per ``tfdp bench`` command (``allreduce``, ``fit``, ``patterns``,
``workers``, ``input``, ``sparse``, ``scaling``, ``overhead``, ``fitcalls``, ``embedding``,
``crossworker``, ``faults``, ``gpu``, ``zero``), each with ``build_parser()``,
``parse_args(argv)`` and ``run(args)``; ``cli`` lists and dispatches them; ``parser`` is the one
argument parser and the shared option checks; ``_common`` the shared measurement helpers;
``_internals`` the private TensorFlow names only benchmarks read; ``trace`` the profiler step
timeline of ``tfdp bench fit --trace``. The parts of a command: ``workloads`` and
``allreduce_report`` (allreduce), ``references`` (allreduce --workers, scaling),
``gpu_sections`` (gpu). The test harnesses that ``tfdp bench patterns`` / ``faults`` print and
tests/test_user_patterns.py, tests/test_zero*.py and tests/test_faults.py run:
``patterns`` (``pattern_base``, ``pattern_rows``, ``pattern_losses``, ``pattern_run``) and
``faults`` (``fault_job``, ``fault_launch``, ``fault_trials``). Nothing here starts TensorFlow
at import.

tfdp's public API (``tfdp.DataParallelStrategy`` and its arguments, ``tfdp.callbacks``,
``tfdp.data``, ``tfdp.launch``, ``tfdp.configure_cpu_replicas``) is what the benchmarks use,
with these exceptions, each imported from the tfdp module that defines it:

* ``tfdp.reduce.registry.ALGORITHMS`` (parser: the ``all_reduce`` names, without TensorFlow),
  ``tfdp.reduce.sparse`` (sparse: the gather/densify rule it measures);
* ``strategy.cross_device_ops`` (tfdp's reducer: ``fit --trace`` names its ops; ``crossworker``
  sets its ``bucket_bytes`` / ``compression`` while tracing each contender, as one job can hold
  only one multi-worker strategy); ``strategy.extended.all_reduce_gradients(grads,
  densify_ok=True)`` (sparse: the call Keras's gradient path makes, so "auto" may densify);
  ``strategy.extended.tfdp_choice`` (gpu: why ``all_reduce="auto"`` chose);
* ``tfdp.compat.tf_internals.nccl_kernel_registered`` (gpu), ``tfdp.devices`` (device names),
  ``tfdp.testing.emit_result`` (faults: the result line of a worker), ``tfdp.logs``;
* ``tfdp.zero`` (zero: the owner plan, ``strategy.extended.tfdp_zero``, and, for ``--workers``,
  one sharding state per contender in the one multi-worker strategy);
* ``tfdp.data.pipeline`` / ``tfdp.data.synthetic`` (input: the pipeline it measures).
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
