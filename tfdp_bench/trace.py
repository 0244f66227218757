"""``tfdp bench fit --trace DIR``: a step timeline from TensorFlow's profiler.

A few steady training steps of a contender run under ``tf.profiler.experimental.start(logdir)`` /
``stop()``; each step is marked with ``tf.profiler.experimental.Trace(STEP_EVENT, step_num=i)``
from a Keras callback. TensorFlow writes ``logdir/plugins/profile/<run>/<host>.xplane.pb`` (what
TensorBoard's profile plugin reads: ``tensorboard --logdir DIR``). This module parses that file
(the ``XSpace`` protobuf TF ships, through :func:`tfdp_bench._internals.read_xspace`), classifies every op
event and writes ``trace.json.gz`` beside it: Chrome trace-event JSON, which Perfetto
(ui.perfetto.dev) and chrome://tracing open, one track per thread, each event tagged with its
class.

Classes (from the op names and types actually seen in TF 2.21 traces):

* **all-reduce**: TF's collective and NCCL ops (``CollectiveReduceV2``, ``NcclAllReduce``...),
  the collective executor's own work (``CollectiveExecutor::*`` events on the ``collective_ops``
  threads, where a CPU collective really runs), and every op created inside a name scope in
  :data:`ALL_REDUCE_SCOPES`. The benchmark wraps each traced contender's cross-device reduction
  in the scope ``tfdp_all_reduce`` (:func:`scope_reductions`), so the packing, adds, casts and
  copies of tfdp's fused/ring reductions and of MirroredStrategy's ``CollectiveAllReduce``
  (its concat/split packing) are counted, not only the collective kernels;
* **compute**: every other op (forward, backward, optimizer, loss, metrics, input); the
  **gradient** compute is the part under Keras's ``gradient_tape`` scope (the backward pass);
* **idle**: the rest of the step's wall time, when no op of either class runs on any thread.

Per step (wall time between the step markers), with |.| the length of a union of intervals over
all threads: compute = |compute|, all-reduce = |all-reduce|, idle = wall - |compute U all-reduce|,
and overlap = |all-reduce n gradient| / |all-reduce|: the fraction of the all-reduce time during
which gradients of the same step were still being computed.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import statistics

from tfdp_bench import _common

STEP_EVENT = "tfdp_bench_step"
ALL_REDUCE_SCOPE = "tfdp_all_reduce"
# name-scope components whose ops are the all-reduce (lower-cased comparison)
ALL_REDUCE_SCOPES = (ALL_REDUCE_SCOPE, "allreduce", "all_reduce", "nccl_all_reduce")
# op types that are communication whatever their scope
ALL_REDUCE_OP_TYPES = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
                       "CollectiveReduceScatterV2", "CollectiveGather", "CollectiveGatherV2",
                       "CollectiveBcastSend", "CollectiveBcastRecv", "CollectiveBcastSendV2",
                       "CollectiveBcastRecvV2", "CollectiveAllToAllV2", "CollectiveAllToAllV3",
                       "NcclAllReduce", "NcclReduce", "NcclBroadcast", "_NcclReducer",
                       "_NcclBroadcastSend", "_NcclBroadcastRecv")
GRADIENT_SCOPE = "gradient_tape"
TABLE_HEADERS = ["step", "wall ms", "compute ms", "all-reduce ms", "idle ms", "overlap %"]
_OP_EVENT = re.compile(r"^(?P<node>[^:\s][^:]*):(?P<type>[A-Za-z_][A-Za-z0-9_]*)$")


# --- capture -------------------------------------------------------------------------------------

def scope_reductions(cross_device_ops, scope: str = ALL_REDUCE_SCOPE):
    """Create every op of ``cross_device_ops``'s reductions inside ``tf.name_scope(scope)``.

    Wraps the instance's entry points, before the train function is traced: the
    ``tf.distribute.CrossDeviceOps`` template methods (``batch_reduce_implementation``,
    ``reduce_implementation``: MirroredStrategy's path and tfdp's, whose gradient path enters its
    ``tfdp.reduce.Reducer`` through ``batch_reduce``), ``all_reduce`` and TF's replica-context
    ``_all_reduce`` (tfdp's reducer inside Keras's gradient accumulation). Nested calls open the
    scope once. Name scopes only rename ops: the computation is unchanged. Returns the
    object.
    """
    import tensorflow as tf

    depth = [0]
    for name in ("batch_reduce_implementation", "reduce_implementation", "all_reduce",
                 "_all_reduce"):
        original = getattr(cross_device_ops, name, None)
        if not callable(original) or getattr(original, "_tfdp_bench_scoped", False):
            continue

        def scoped(*args, _original=original, **kwargs):
            if depth[0]:
                return _original(*args, **kwargs)
            depth[0] += 1
            try:
                with tf.name_scope(scope):
                    return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        scoped._tfdp_bench_scoped = True
        setattr(cross_device_ops, name, scoped)
    return cross_device_ops


def step_marker():
    """A Keras callback marking each training batch as a profiler step (``STEP_EVENT``)."""
    import keras
    import tensorflow as tf

    class StepMarker(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._trace = None

        def on_train_batch_begin(self, batch, logs=None):
            self._trace = tf.profiler.experimental.Trace(STEP_EVENT, step_num=batch, _r=1)
            self._trace.__enter__()

        def on_train_batch_end(self, batch, logs=None):
            if self._trace is not None:
                self._trace.__exit__(None, None, None)
                self._trace = None

    return StepMarker()


def warm_up(run_steps) -> None:
    """A throw-away profiling session around ``run_steps([])`` (nothing is saved).

    The first profiling session of a process pays the profiler's set-up during its steps:
    measured on 4 CPU replicas, the first contender traced ran 1.5-4x slower than its untraced
    steps, whichever it was, and later ones did not.
    """
    import tensorflow as tf

    tf.profiler.experimental.start("")
    try:
        run_steps([])
    finally:
        tf.profiler.experimental.stop(save=False)


def capture(run_steps, logdir: str) -> str:
    """Run ``run_steps(callbacks)`` under the profiler writing to ``logdir``; the xplane path."""
    import tensorflow as tf

    os.makedirs(logdir, exist_ok=True)
    before = set(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))
    tf.profiler.experimental.start(logdir)
    try:
        run_steps([step_marker()])
    finally:
        tf.profiler.experimental.stop()
    after = set(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))
    new = sorted(after - before) or sorted(after)
    if not new:
        from tfdp.errors import TfdpError
        raise TfdpError(f"The profiler wrote no trace. Received: logdir {logdir!r} with no "
                        "plugins/profile/*/*.xplane.pb after tf.profiler.experimental.stop(). "
                        "Check that this TensorFlow build has the profiler.")
    return new[-1]


# --- parse ---------------------------------------------------------------------------------------

def classify(node: str, op_type: str) -> str:
    """'all-reduce' or 'compute' for an op event ``node:op_type``."""
    if op_type in ALL_REDUCE_OP_TYPES or op_type.startswith(("Collective", "Nccl", "_Nccl")):
        return "all-reduce"
    parts = [p.lower() for p in node.split("/")]
    if any(p in ALL_REDUCE_SCOPES or p.startswith(ALL_REDUCE_SCOPES) for p in parts):
        return "all-reduce"
    return "compute"


def _stat_value(plane, stat):
    if stat.HasField("ref_value"):
        return plane.stat_metadata[stat.ref_value].name
    for field in ("str_value", "int64_value", "uint64_value", "double_value"):
        if stat.HasField(field):
            return getattr(stat, field)
    return None


def load_events(xplane_path: str) -> dict:
    """The op events and step markers of a trace: {"events": [...], "steps": [...]}.

    Each event: {"name", "type", "cls", "gradient", "thread", "plane", "start_ns", "end_ns"};
    each step: {"step", "start_ns", "end_ns"}. Host op events come from ``node:OpType`` events;
    device (GPU) kernels are taken through their ``tf_op`` stat, and when a trace has any, they
    replace the host's spans of the same ops (which are only their launches).
    """
    from tfdp_bench._internals import read_xspace
    space = read_xspace(xplane_path)
    events, steps = [], []
    for plane in space.planes:
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        on_device = "/device:" in plane.name
        for line in plane.lines:
            base_ns = line.timestamp_ns
            thread = line.display_name or line.name
            collective_line = line.name.startswith("collective_ops")
            for e in line.events:
                md = plane.event_metadata[e.metadata_id]
                name = md.name
                start = base_ns + e.offset_ps / 1e3
                end = start + e.duration_ps / 1e3
                if name == STEP_EVENT:
                    num = next((_stat_value(plane, s) for s in e.stats
                                if stat_names.get(s.metadata_id) == "step_num"), None)
                    steps.append({"step": int(num) if num is not None else len(steps),
                                  "start_ns": start, "end_ns": end})
                    continue
                if e.duration_ps <= 0:
                    continue
                node = op_type = None
                m = _OP_EVENT.match(name) if "::" not in name else None
                if m:
                    node, op_type = m.group("node"), m.group("type")
                elif collective_line and name.startswith("CollectiveExecutor::RunClosure"):
                    node, op_type = "collective_executor", "CollectiveExecutor"
                elif on_device:
                    tf_op = next((_stat_value(plane, s) for s in list(e.stats) + list(md.stats)
                                  if stat_names.get(s.metadata_id) == "tf_op"), None)
                    if isinstance(tf_op, str) and ":" in tf_op:
                        node, _, op_type = tf_op.rpartition(":")
                    elif "nccl" in name.lower():
                        node, op_type = name, "NcclAllReduce"
                if node is None:
                    continue
                events.append({"name": node, "type": op_type, "cls": classify(node, op_type),
                               "gradient": GRADIENT_SCOPE in node, "thread": thread,
                               "plane": plane.name, "start_ns": start, "end_ns": end})
    steps.sort(key=lambda s: s["start_ns"])
    if any("/device:" in e["plane"] for e in events):
        # GPU ops appear twice: as kernel launches on the host's executor threads and as kernels
        # on the device; keep the device's spans (and the host's collective executor work).
        events = [e for e in events if "/device:" in e["plane"] or e["type"] ==
                  "CollectiveExecutor"]
    return {"events": events, "steps": steps}


def _union(intervals):
    """Sorted, merged [(start, end)]."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1][1] = b
        else:
            out.append([a, b])
    return out


def _length(merged) -> float:
    return sum(b - a for a, b in merged)


def _intersection_length(x, y) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            total += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def step_timeline(trace: dict) -> list[dict]:
    """Per marked step: wall, compute, all-reduce, idle (ms) and overlap (fraction or None)."""
    rows = []
    for s in trace["steps"]:
        lo, hi = s["start_ns"], s["end_ns"]

        def clipped(pred, lo=lo, hi=hi):
            return _union([(max(e["start_ns"], lo), min(e["end_ns"], hi))
                           for e in trace["events"]
                           if pred(e) and e["end_ns"] > lo and e["start_ns"] < hi])

        compute = clipped(lambda e: e["cls"] == "compute")
        reduce_ = clipped(lambda e: e["cls"] == "all-reduce")
        grad = clipped(lambda e: e["cls"] == "compute" and e["gradient"])
        busy = _union([tuple(iv) for iv in compute + reduce_])
        wall = hi - lo
        ar = _length(reduce_)
        rows.append({"step": s["step"], "wall_ms": wall / 1e6,
                     "compute_ms": _length(compute) / 1e6, "all_reduce_ms": ar / 1e6,
                     "gradient_ms": _length(grad) / 1e6,
                     "idle_ms": max(0.0, wall - _length(busy)) / 1e6,
                     "all_reduce_exposed_ms": (ar - _intersection_length(reduce_, compute)) / 1e6,
                     "overlap": _intersection_length(reduce_, grad) / ar if ar > 0 else None})
    return rows


def op_summary(trace: dict, top: int = 8) -> dict:
    """Per class: total op time (ms, summed over threads) and the op types that took most."""
    out = {}
    for cls in ("all-reduce", "compute"):
        per_type = {}
        for e in trace["events"]:
            if e["cls"] == cls:
                per_type[e["type"]] = per_type.get(e["type"], 0.0) + e["end_ns"] - e["start_ns"]
        ranked = sorted(per_type.items(), key=lambda kv: -kv[1])
        out[cls] = {"total_ms": sum(per_type.values()) / 1e6,
                    "top_op_types": [[t, v / 1e6] for t, v in ranked[:top]]}
    return out


def write_chrome_trace(trace: dict, path: str) -> None:
    """The classified events as Chrome trace-event JSON (gzip), for Perfetto / chrome://tracing."""
    threads = {}
    out = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "tfdp bench fit"}}]
    t0 = min([e["start_ns"] for e in trace["events"]] + [s["start_ns"] for s in trace["steps"]]
             or [0.0])
    for e in trace["events"]:
        key = (e["plane"], e["thread"])
        if key not in threads:
            threads[key] = len(threads) + 1
            out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": threads[key],
                        "args": {"name": f"{e['thread']} ({e['plane']})"}})
        out.append({"name": f"{e['name']}:{e['type']}", "cat": e["cls"], "ph": "X", "pid": 1,
                    "tid": threads[key], "ts": (e["start_ns"] - t0) / 1e3,
                    "dur": (e["end_ns"] - e["start_ns"]) / 1e3,
                    "args": {"class": e["cls"], "gradient": e["gradient"]}})
    out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": 0,
                "args": {"name": "steps"}})
    for s in trace["steps"]:
        out.append({"name": f"step {s['step']}", "cat": "step", "ph": "X", "pid": 1, "tid": 0,
                    "ts": (s["start_ns"] - t0) / 1e3, "dur": (s["end_ns"] - s["start_ns"]) / 1e3})
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)


# --- report --------------------------------------------------------------------------------------

def _fmt_overlap(x) -> str:
    return "-" if x is None else f"{x * 100:.1f}"


def summarize_steps(rows: list[dict]) -> dict:
    """Medians over the steps (overlap over the steps that had an all-reduce)."""
    def med(key):
        vals = [r[key] for r in rows if r[key] is not None]
        return statistics.median(vals) if vals else None
    return {k: med(k) for k in ("wall_ms", "compute_ms", "all_reduce_ms", "idle_ms", "overlap",
                                "gradient_ms", "all_reduce_exposed_ms")}


def format_timeline(name: str, rows: list[dict]) -> str:
    """The per-step table of one contender (``TABLE_HEADERS``), then the medians."""
    body = [[r["step"], f"{r['wall_ms']:.2f}", f"{r['compute_ms']:.2f}",
             f"{r['all_reduce_ms']:.2f}", f"{r['idle_ms']:.2f}", _fmt_overlap(r["overlap"])]
            for r in rows]
    m = summarize_steps(rows)
    if rows:
        body.append(None)
        body.append(["median", f"{m['wall_ms']:.2f}", f"{m['compute_ms']:.2f}",
                     f"{m['all_reduce_ms']:.2f}", f"{m['idle_ms']:.2f}",
                     _fmt_overlap(m["overlap"])])
    return f"step timeline: {name}\n" + _common.render_table(TABLE_HEADERS, body)


TABLE_NOTE = ("compute / all-reduce: wall time (ms) during which at least one op of that class "
              "ran on any thread;\nidle: neither; overlap %: share of the all-reduce time during "
              "which the same step's backward pass\n(ops under Keras's gradient_tape scope) was "
              "still computing.")


def parse_table(text: str) -> list[dict]:
    """Read back the per-step rows of :func:`format_timeline` output (tests, scripts)."""
    rows = []
    for ln in text.splitlines():
        cells = ln.split()
        if len(cells) == len(TABLE_HEADERS) and cells[0].isdigit():
            rows.append({"step": int(cells[0]), "wall_ms": float(cells[1]),
                         "compute_ms": float(cells[2]), "all_reduce_ms": float(cells[3]),
                         "idle_ms": float(cells[4]),
                         "overlap": None if cells[5] == "-" else float(cells[5]) / 100})
    return rows


def slug(name: str) -> str:
    """A directory name for a contender: 'MS CollectiveAllReduce(RING)' ->
    'ms_collectiveallreduce_ring'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "run"


def trace_contender(name: str, run_steps, logdir: str, skip_steps: int = 0) -> dict:
    """Capture, parse and tabulate one contender; writes trace.json.gz and timeline.txt.

    ``run_steps(callbacks)`` runs the steps (e.g. a ``model.fit`` with those callbacks); the
    table leaves out steps numbered below ``skip_steps`` (the first step of a fit also starts
    its input iterators).
    """
    xplane = capture(run_steps, logdir)
    trace = load_events(xplane)
    rows = [r for r in step_timeline(trace) if r["step"] >= skip_steps]
    chrome = os.path.join(logdir, "trace.json.gz")
    write_chrome_trace(trace, chrome)
    table = format_timeline(name, rows)
    with open(os.path.join(logdir, "timeline.txt"), "w") as f:
        f.write(table + "\n\n" + TABLE_NOTE + "\n")
    return {"contender": name, "logdir": logdir, "xplane": xplane, "chrome_trace": chrome,
            "steps": rows, "median": summarize_steps(rows), "ops": op_summary(trace),
            "table": table}
