"""Throughput and step-time monitoring for Keras ``fit``, and a straggler report across workers.

``Throughput(global_batch_size, num_replicas, log_dir=None)`` records the wall time of every
training step (``on_train_batch_begin`` -> ``on_train_batch_end``) and of the host time between
steps, and reports examples/s (global and per replica) and p50/p90/p99 step times. With
``log_dir`` it writes them as TensorBoard scalars at the end of every epoch.

Across several workers, :func:`straggler_report` gathers each worker's figures through the
strategy (one all-gather with one row per worker; nothing at all with one worker) and names the
slowest. What can and cannot be seen from outside the step: in synchronous training every
worker's step ends at the same gradient all-reduce, so a worker that is slow *inside* the step
makes every worker's step equally long (the fast ones wait in the all-reduce). What differs per
worker is its own time *outside* the step (host work: callbacks, Python, input not prefetched);
in-step slowness needs a local, communication-free measurement (``tfdp train`` times a short
1-replica run on every worker for that).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import keras

from tfdp.errors import invalid_argument


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise invalid_argument(name, v, fix="Pass a positive int.")


def percentiles_ms(seconds, qs=(50, 90, 99)) -> dict:
    """``{"p50": ms, "p90": ms, "p99": ms}`` of a list of durations in seconds (empty: {})."""
    if not len(seconds):
        return {}
    values = np.percentile(np.asarray(seconds, dtype=np.float64) * 1e3, qs)
    return {f"p{q}": float(v) for q, v in zip(qs, values)}


class Throughput(keras.callbacks.Callback):
    """Examples/s and step-time percentiles of a Keras ``fit`` (optionally as TensorBoard scalars).

    Args:
      global_batch_size: examples per training step across all replicas and workers.
      num_replicas: ``strategy.num_replicas_in_sync``.
      log_dir: if given, TensorBoard scalars ``throughput/examples_per_sec``,
        ``throughput/examples_per_sec_per_replica`` and ``step_time_ms/p50|p90|p99`` are written
        there at the end of every epoch (for that epoch's steps) and at the end of training
        (``.../total``, for all of them).
      skip_steps: leading steps left out of the figures (the first includes tracing).
      examples_per_epoch: if given, the last step of each epoch counts only the remainder
        (``examples_per_epoch % global_batch_size``) when the epoch ends with a partial batch.
      stragglers: at the end of training with several workers, gather every worker's figures and
        keep a :class:`StragglerReport` in ``.stragglers`` (every worker must run it).

    After ``fit``: ``summary()`` (a dict), ``step_times`` (seconds), ``stragglers``.
    """

    def __init__(self, global_batch_size: int, num_replicas: int, log_dir: str | None = None, *,
                 skip_steps: int = 1, examples_per_epoch: int | None = None,
                 stragglers: bool = True):
        super().__init__()
        _positive_int("global_batch_size", global_batch_size)
        _positive_int("num_replicas", num_replicas)
        if isinstance(skip_steps, bool) or not isinstance(skip_steps, int) or skip_steps < 0:
            raise invalid_argument("skip_steps", skip_steps, fix="Pass an int >= 0.")
        if examples_per_epoch is not None:
            _positive_int("examples_per_epoch", examples_per_epoch)
        self.global_batch_size = global_batch_size
        self.num_replicas = num_replicas
        self.log_dir = log_dir
        self.skip_steps = skip_steps
        self.examples_per_epoch = examples_per_epoch
        self.report_stragglers = stragglers
        self.stragglers = None
        self._writer = None
        self._reset()

    def _reset(self):
        self.step_times: list[float] = []
        self.step_examples: list[int] = []
        self.gaps: list[float] = []
        self._epoch_from = 0
        self._seen = 0
        self._t0 = None
        self._last_end = None

    # --- Keras hooks ---------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._reset()
        self.stragglers = None
        if self.log_dir and self._writer is None:
            import tensorflow as tf
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_from = len(self.step_times)
        self._last_end = None  # the time between epochs (validation, callbacks) is not a gap

    def on_train_batch_begin(self, batch, logs=None):
        self._t0 = time.perf_counter()
        if self._last_end is not None and self._seen >= self.skip_steps:
            self.gaps.append(self._t0 - self._last_end)

    def on_train_batch_end(self, batch, logs=None):
        end = time.perf_counter()
        self._seen += 1
        self._last_end = end
        if self._t0 is None or self._seen <= self.skip_steps:
            return
        self.step_times.append(end - self._t0)
        self.step_examples.append(self._examples_in_step(batch))

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is not None:
            self._write(self._figures(slice(self._epoch_from, None)), step=epoch, suffix="")

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._write(self._figures(slice(None)), step=0, suffix="/total")
            self._writer.flush()
        if self.report_stragglers and self.model is not None:
            self.stragglers = straggler_report(self.model.distribute_strategy,
                                               self.straggler_figures())

    # --- figures -------------------------------------------------------------------------------

    def _examples_in_step(self, batch) -> int:
        b = self.global_batch_size
        steps = (self.params or {}).get("steps")
        if self.examples_per_epoch and steps:
            full, rest = divmod(self.examples_per_epoch, b)
            if rest and steps == full + 1 and batch == steps - 1:
                return rest
        return b

    def _figures(self, part: slice) -> dict:
        times = self.step_times[part]
        examples = self.step_examples[part]
        if not times:
            return {}
        seconds = float(sum(times))
        eps = sum(examples) / seconds if seconds > 0 else float("nan")
        out = {"steps": len(times), "examples": int(sum(examples)), "seconds": seconds,
               "examples_per_sec": eps, "examples_per_sec_per_replica": eps / self.num_replicas,
               "step_time_ms_mean": seconds / len(times) * 1e3}
        out.update({f"step_time_ms_{k}": v for k, v in percentiles_ms(times).items()})
        return out

    def summary(self) -> dict:
        """Figures over all measured steps: ``steps``, ``examples``, ``seconds``,
        ``examples_per_sec``, ``examples_per_sec_per_replica``, ``step_time_ms_mean|p50|p90|p99``,
        ``gap_ms_p50`` (host time between steps). Empty before any step was measured."""
        out = self._figures(slice(None))
        if out:
            out["gap_ms_p50"] = percentiles_ms(self.gaps, (50,)).get("p50", 0.0)
        return out

    def straggler_figures(self) -> dict:
        """This worker's figures for :func:`straggler_report` (p50 step and host gap, ms)."""
        s = self.summary()
        return {"step_ms_p50": s.get("step_time_ms_p50", 0.0),
                "host_gap_ms_p50": s.get("gap_ms_p50", 0.0)}

    def _write(self, figures, step, suffix):
        if not figures:
            return
        import tensorflow as tf
        names = {"examples_per_sec": "throughput/examples_per_sec",
                 "examples_per_sec_per_replica": "throughput/examples_per_sec_per_replica",
                 "step_time_ms_p50": "step_time_ms/p50", "step_time_ms_p90": "step_time_ms/p90",
                 "step_time_ms_p99": "step_time_ms/p99"}
        # tf.summary.write with the scalars plugin's metadata: what tf.summary.scalar writes, but
        # without needing the tensorboard package (tensorflow-cpu does not install it).
        meta = tf.compat.v1.SummaryMetadata(
            plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"),
            data_class=1)  # DATA_CLASS_SCALAR
        with self._writer.as_default():
            for key, tag in names.items():
                if key in figures:
                    tf.summary.write(tag + suffix, tf.constant(figures[key], tf.float32),
                                     step=step, metadata=meta)


# --- across workers ------------------------------------------------------------------------------

def num_workers(strategy) -> int:
    """Worker processes behind ``strategy`` (``tfdp.strategy.worker_role(strategy).count``; 1
    for TF's default strategy)."""
    from tfdp.strategy.role import worker_role
    return worker_role(strategy).count


def worker_rank(strategy) -> int:
    """This worker's rank (``tfdp.strategy.worker_role(strategy).index``)."""
    from tfdp.strategy.role import worker_role
    return worker_role(strategy).index


def gather_per_worker(strategy, values) -> np.ndarray:
    """Every worker's ``values`` (same length everywhere): an array of shape (workers, len).

    One all-gather through the strategy (every worker must call it, in the same order); with a
    single worker the values are returned as they are, without any communication. Row ``i``
    belongs to worker (rank) ``i``.
    """
    values = [float(v) for v in values]
    workers = num_workers(strategy)
    if workers == 1:
        return np.asarray([values], dtype=np.float64)
    import tensorflow as tf
    row = tf.constant([[float(worker_rank(strategy))] + values], tf.float32)
    per_replica = strategy.experimental_distribute_values_from_function(lambda _ctx: row)
    gathered = np.asarray(strategy.gather(per_replica, axis=0), dtype=np.float64)
    rows = {}
    for r in gathered:  # one row per replica: keep one per worker, ordered by rank
        rows.setdefault(int(round(r[0])), r[1:])
    return np.stack([rows[k] for k in sorted(rows)])


_ARRIVAL_PERIOD_S = 1000.0   # float32 keeps ~0.1 ms of a time of day folded into 1000 s


@dataclasses.dataclass
class StragglerReport:
    """Per-worker figures (``figures[name][rank]``) and the slowest worker."""

    figures: dict
    rank_by: tuple
    slowest: int
    fastest: int
    own_ms: list
    #: when each worker reached the all-gather: ``time.time()`` modulo ``_ARRIVAL_PERIOD_S`` (it
    #: travels as float32), as that worker's host clock tells
    arrived_at: list = dataclasses.field(default_factory=list)

    def waited_s(self, rank: int) -> float:
        """How long worker ``rank`` waited at the all-gather for the last worker to reach it
        (0 for the last one; across hosts only as good as their clocks agree)."""
        if not self.arrived_at:
            return 0.0
        half = _ARRIVAL_PERIOD_S / 2
        own = self.arrived_at[rank]
        later = [((t - own + half) % _ARRIVAL_PERIOD_S) - half for t in self.arrived_at]
        return max(0.0, max(later))

    @property
    def ratio(self) -> float:
        low = self.own_ms[self.fastest]
        return self.own_ms[self.slowest] / low if low > 0 else float("inf")

    def text(self) -> str:
        names = list(self.figures)
        rows = []
        for w in range(len(self.own_ms)):
            rows.append(f"worker {w}: " + ", ".join(
                f"{n.replace('_ms_p50', '').replace('_ms', '').replace('_', ' ')} "
                f"{self.figures[n][w]:.1f} ms" for n in names))
        what = " + ".join(n.replace("_ms_p50", "").replace("_ms", "").replace("_", " ")
                          for n in self.rank_by)
        return (f"{len(self.own_ms)} workers; " + "; ".join(rows)
                + f". Slowest: worker {self.slowest} ({what} {self.own_ms[self.slowest]:.1f} ms,"
                f" {self.ratio:.2f}x worker {self.fastest})")


def straggler_report(strategy, figures: dict, rank_by=None) -> StragglerReport | None:
    """Gather per-worker ``figures`` (name -> ms on this worker) and name the slowest worker.

    ``rank_by``: the figures whose sum is a worker's own time per step (default: the host gap
    between steps when present, else every figure). Returns None with a single worker (no
    communication at all). Every worker must call it with the same figure names. The report
    also says how long each worker waited there for the last one to arrive
    (:meth:`StragglerReport.waited_s`): time spent on the others' work, not its own.
    """
    names = list(figures)
    workers = num_workers(strategy)
    table = gather_per_worker(strategy, [figures[n] for n in names]
                              + ([time.time() % _ARRIVAL_PERIOD_S] if workers > 1 else []))
    if workers == 1:
        return None
    arrived_at, table = [float(x) for x in table[:, -1]], table[:, :-1]
    if rank_by is None:
        rank_by = ("host_gap_ms_p50",) if "host_gap_ms_p50" in figures else tuple(names)
    idx = [names.index(n) for n in rank_by]
    own = table[:, idx].sum(axis=1)
    per_worker = {n: [float(x) for x in table[:, i]] for i, n in enumerate(names)}
    return StragglerReport(figures=per_worker, rank_by=tuple(rank_by), slowest=int(np.argmax(own)),
                           fastest=int(np.argmin(own)), own_ms=[float(x) for x in own],
                           arrived_at=arrived_at)
