"""The output of ``tfdp bench allreduce`` (:mod:`tfdp_bench.allreduce`): its table and its
``--plot`` (bus bandwidth per size, matplotlib). No TensorFlow.
"""

from __future__ import annotations

from tfdp.errors import TfdpError
from tfdp_bench import _common, workers


# --- output --------------------------------------------------------------------------------------

REFERENCE_KINDS = ("numpy", "memory", "tcp")


def format_allreduce(result: dict) -> str:
    if result.get("mode") == "workers":
        return workers.format_workers(result)
    k = result["cpu_replicas"]
    env = result["environment"]
    lines = [f"tfdp bench allreduce: model {result['model']}, {k} CPU replicas "
             f"({env['cpu_cores']} cores), {result['repeats']} rounds, TF {env['tensorflow']}",
             f"MirroredStrategy default cross_device_ops: {result['mirrored_cross_device_ops']}"]
    headers = ["contender", "median ms", "min ms", "algbw GB/s", "busbw GB/s", "MS/this"]
    sizes_mode = result["model"] == "sizes"
    if sizes_mode:
        headers = ["size"] + headers
    rows = []
    for w in result["workloads"]:
        if not sizes_mode:
            lines.append(f"workload {w['name']}: {w['tensors']} float32 tensors, "
                         f"{w['bytes']:,} bytes ({w['bytes'] / 1e6:.1f} MB) per replica")
        elif rows:
            rows.append(None)
        for i, r in enumerate(w["results"]):
            row = [r["contender"], f"{r['median_s'] * 1e3:.3f}", f"{r['min_s'] * 1e3:.3f}",
                   f"{r['algbw_gbps']:.2f}", f"{r['busbw_gbps']:.2f}",
                   f"{r['ratio_mirrored_over_this']:.2f}"]
            rows.append(([w["name"] if i == 0 else ""] if sizes_mode else []) + row)
    right = set(range(2 if sizes_mode else 1, len(headers)))
    lines += ["", _common.render_table(headers, rows, right=right), "",
              "MS/this = MirroredStrategy (default cross_device_ops) median / this median; "
              "> 1: faster than MirroredStrategy.",
              f"busbw = algbw * 2(K-1)/K. The numpy row is a one-thread {k}-way sum with no "
              "broadcast: a memory-bound reference, not an all-reduce.",
              _common.memory_note(result)]
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> None:
    """busbw vs size per contender (sizes mode), else busbw per contender as bars."""
    try:
        import matplotlib
    except ImportError:
        raise TfdpError(
            f"--plot needs matplotlib, which is not installed. Received: --plot {path!r}. "
            "Install it (pip install matplotlib) or drop --plot.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    workers = result.get("mode") == "workers"
    where = (f"{result['workers']} workers over loopback" if workers
             else f"{result['cpu_replicas']} CPU replicas")
    if result["model"] == "sizes":
        kinds = {c["name"]: c["kind"] for c in result["contenders"]}
        for name in kinds:
            xs, ys = [], []
            for w in result["workloads"]:
                r = next((r for r in w["results"] if r["contender"] == name), None)
                if r is not None:
                    xs.append(w["bytes"])
                    ys.append(r["busbw_gbps"])
            ax.plot(xs, ys, marker="o", label=name,
                    linestyle="--" if kinds[name] in REFERENCE_KINDS else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = [w["bytes"] for w in result["workloads"]]
        ax.set_xticks(ticks, [_common.fmt_bytes(t) for t in ticks])
        ax.set_xlabel("bytes per worker" if workers else "bytes per replica")
        ax.set_ylabel("busbw (GB/s)")
        ax.legend(fontsize=8)
    else:
        w = result["workloads"][0]
        names = [r["contender"] for r in w["results"]]
        ax.barh(names, [r["busbw_gbps"] for r in w["results"]])
        ax.invert_yaxis()
        ax.set_xlabel("busbw (GB/s)")
    ax.set_title(f"all-reduce busbw, {where} ({result['model']}); dashed: references")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
