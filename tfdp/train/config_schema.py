"""The schema of ``tfdp train`` configs (:mod:`tfdp.train.config`): the value checkers, the
keys of every section, source and model kind, and the ``--tiny`` sizes.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


# --- value checkers: (value) -> normalised value, or raise _Bad(expected) ---------------------


class _Bad(Exception):
    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


def _int(lo=None, hi=None):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) \
                or (hi is not None and v > hi):
            raise _Bad("an integer" + (f" >= {lo}" if lo is not None else "")
                       + (f" and <= {hi}" if hi is not None else ""))
        return v
    check.kind = "int"
    return check


def _float(lo=None, lo_open=False, hi=None):
    def check(v):
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        if ok and lo is not None:
            ok = v > lo if lo_open else v >= lo
        if ok and hi is not None:
            ok = v <= hi
        if not ok:
            bound = "" if lo is None else f" {'>' if lo_open else '>='} {lo}"
            bound += "" if hi is None else f" and <= {hi}"
            raise _Bad("a number" + bound)
        return float(v)
    check.kind = "float"
    return check


def _str():
    def check(v):
        if not isinstance(v, str) or not v:
            raise _Bad("a non-empty string")
        return v
    check.kind = "str"
    return check


def _bool():
    def check(v):
        if not isinstance(v, bool):
            raise _Bad("true or false")
        return v
    check.kind = "bool"
    return check


def _choice(*choices):
    def check(v):
        if not isinstance(v, str) or v.lower() not in choices:
            raise _Bad("one of " + ", ".join(repr(c) for c in choices))
        return v.lower()
    check.kind = "str"
    check.choices = choices
    return check


def _int_list(lo=1):
    def check(v):
        if not isinstance(v, list) or not v or any(
                isinstance(x, bool) or not isinstance(x, int) or x < lo for x in v):
            raise _Bad(f"a non-empty array of integers >= {lo}, e.g. [64, 32]")
        return list(v)
    check.kind = "list"
    return check


def _str_list():
    def check(v):
        if not isinstance(v, list) or any(not isinstance(x, str) or not x for x in v):
            raise _Bad('an array of strings, e.g. ["accuracy"]')
        return list(v)
    check.kind = "list"
    return check


@dataclass(frozen=True)
class Key:
    check: Callable
    default: Any = None          # None: optional with no default (or required, see below)
    required: bool = False
    help: str = ""


# The strategy's all_reduce names (tfdp/reduce/registry.py; importing tfdp.reduce would start
# TensorFlow, so they are repeated here and a test keeps the two lists equal).
ALGORITHMS = ("auto", "fused", "ring", "one_device", "nccl")

SECTIONS: dict[str, dict[str, Key]] = {
    "job": {
        "name": Key(_str(), None, help="job name in the summary (default: the file's stem)"),
        "seed": Key(_int(0), 0, help="seed for weights initialisation and synthetic data"),
    },
    "strategy": {
        "cpu_replicas": Key(_int(1), 1, help="logical CPU replicas per worker when there is no "
                            "GPU (TFDP_CPU_REPLICAS overrides it; GPUs: all local GPUs are used)"),
        "all_reduce": Key(_choice(*ALGORITHMS), "auto", help="reduction algorithm"),
        "bucket_bytes": Key(_int(0), None, help="fused bucket capacity (default: tfdp's)"),
        "compression": Key(_choice("none", "fp16", "bf16"), "none",
                           help="gradient compression on the wire"),
        "zero_stage": Key(_int(0, 2), 0, help="sharded optimizer state (tfdp.zero): 0 off, 1 "
                          "each variable's slots on one owner replica, 2 also its gradient "
                          "summed onto the owner only"),
    },
    "train": {
        "epochs": Key(_int(1), 1),
        "steps_per_epoch": Key(_int(1), None, help="default: one pass over the training data"),
        "eval_steps": Key(_int(1), None, help="default: the whole evaluation set"),
        "optimizer": Key(_choice("sgd", "adam", "adamw"), "adam"),
        "learning_rate": Key(_float(0, lo_open=True), 1e-3,
                             help="base learning rate (at base_batch_size with lr_scaling)"),
        "momentum": Key(_float(0, hi=1), 0.9, help="SGD momentum"),
        "weight_decay": Key(_float(0), 0.0, help="AdamW / SGD weight decay"),
        "lr_scaling": Key(_choice("none", "linear"), "none",
                          help="'linear': lr = learning_rate * global_batch / base_batch_size "
                               "(Goyal et al. 2017)"),
        "base_batch_size": Key(_int(1), 256, help="the batch learning_rate was tuned for"),
        "warmup_epochs": Key(_float(0), 0.0, help="linear warm-up from learning_rate to the "
                             "scaled rate over this many epochs"),
        "schedule": Key(_choice("constant", "cosine"), "constant",
                        help="after warm-up: keep the rate, or cosine-decay it to 0"),
        "precise_bn_batches": Key(_int(0), 16, help="after training, recompute BatchNorm "
                                  "moving statistics from this many training batches of the "
                                  "per-replica size with the final weights (0: off; models "
                                  "without BatchNorm: nothing done)"),
    },
    "monitor": {
        "log_dir": Key(_str(), None, help="TensorBoard directory (throughput scalars + metrics)"),
        "allreduce_estimate": Key(_bool(), True, help="estimate the all-reduce share of the "
                                  "step from a separate micro-benchmark"),
        "scaling_baseline": Key(_bool(), False, help="also time 1 replica (per-replica batch) "
                                "and print the scaling efficiency"),
        "baseline_steps": Key(_int(2), 20),
        "stragglers": Key(_bool(), True, help="multi-worker: per-worker times, slowest named"),
    },
    "targets": {
        "min_accuracy": Key(_float(0, hi=1)),
        "max_loss": Key(_float(0)),
        "min_auc": Key(_float(0, hi=1)),
        "max_step_time_ms": Key(_float(0, lo_open=True), help="median (p50) step time; "
                                "absolute: holds only on the machine (and load) it was set on"),
        "min_examples_per_sec": Key(_float(0), help="absolute, as max_step_time_ms"),
        "min_scaling_efficiency": Key(_float(0), help="relative: vs 1 replica in the same run "
                                      "(needs the scaling baseline)"),
    },
}

# [data]: keys common to every source, then each source's own
DATA_COMMON = {
    "source": Key(_choice("digits", "cifar10", "synthetic_text", "interactions"), required=True),
    "global_batch_size": Key(_int(1), required=True,
                             help="examples per step across all replicas and workers"),
    "shuffle_seed": Key(_int(0), 0),
}
SOURCES: dict[str, dict[str, Key]] = {
    "digits": {
        "test_examples": Key(_int(1, 1000), 360, help="held-out images of the 1,797"),
    },
    "cifar10": {
        "synthetic": Key(_choice("auto", "always", "never"), "auto",
                         help="'auto': tfds cifar10 if prepared locally, else a SYNTHETIC "
                              "stand-in; 'never': error when cifar10 is not prepared"),
        "data_dir": Key(_str(), None, help="tfds data directory"),
        "train_examples": Key(_int(1), 50_000, help="training examples used (tfds: a prefix)"),
        "eval_examples": Key(_int(1), 10_000),
    },
    "synthetic_text": {
        "vocab_size": Key(_int(16), 1000),
        "seq_len": Key(_int(8), 32),
        "train_examples": Key(_int(1), 8192),
        "eval_examples": Key(_int(1), 1024),
        "mask_rate": Key(_float(0, lo_open=True, hi=1), 0.15),
    },
    "interactions": {
        "dir": Key(_str(), None, help="TFRecord directory (written on first use; default: "
                   "~/.cache/tfdp/interactions-<sizes>)"),
        "num_files": Key(_int(1), 8, help="training shards (each worker reads its own)"),
        "examples_per_file": Key(_int(1), 4096),
        "eval_files": Key(_int(1), 1),
        "num_users": Key(_int(2), 10_000),
        "num_items": Key(_int(2), 50_000),
    },
}

MODEL_COMMON = {
    "kind": Key(_choice("cnn", "resnet", "bert", "dlrm"), required=True),
}

# [data] builder / [model] builder: your own function, "package.module:function". The other keys
# of the table are its keyword arguments (checked against its signature when it is imported, at
# the start of the run); [data] keeps global_batch_size and shuffle_seed, [model] keeps loss and
# metrics (used when the function returns a bare model).
BUILDER_KEY = "builder"
DATA_BUILDER_KEYS = {
    "builder": Key(_str(), required=True, help='"module:function" (the config\'s folder and the '
                   "working directory are importable): function(input_context=..., **keys) -> "
                   "per-replica batched (train, eval) datasets, or function(global_batch_size="
                   "..., **keys) -> globally batched (train, eval) datasets"),
    "global_batch_size": DATA_COMMON["global_batch_size"],
    "shuffle_seed": DATA_COMMON["shuffle_seed"],
}
MODEL_BUILDER_KEYS = {
    "builder": Key(_str(), required=True, help='"module:function": function(**keys) -> a Keras '
                   "model (compiled by tfdp train), or (model, loss), or (model, loss, metrics)"),
    "loss": Key(_str(), None, help="a Keras loss name, when the function returns a bare model"),
    "metrics": Key(_str_list(), None, help='Keras metric names, e.g. ["accuracy"]'),
}
MODELS: dict[str, dict[str, Key]] = {
    "cnn": {"filters": Key(_int(1), 32), "dense_units": Key(_int(1), 64)},
    "resnet": {"depth": Key(_int(8), 20, help="6n+2: 8, 14, 20, 32, 44, 56, 110"),
               "width": Key(_int(1), 16, help="filters of the first stage (x2, x4 after)")},
    "bert": {"layers": Key(_int(1), 2), "hidden": Key(_int(8), 64), "heads": Key(_int(1), 2),
             "intermediate": Key(_int(1), 256), "dropout": Key(_float(0, hi=0.9), 0.0)},
    "dlrm": {"embedding_dim": Key(_int(1), 16), "bottom_units": Key(_int_list(), [32]),
             "top_units": Key(_int_list(), [64, 32])},
}
# model kind -> data sources it can train on
MODEL_SOURCES = {"cnn": ("digits", "cifar10"), "resnet": ("digits", "cifar10"),
                 "bert": ("synthetic_text",), "dlrm": ("interactions",)}
# metric each target needs (checked against the model kind)
TARGET_METRIC = {"min_accuracy": "accuracy", "max_loss": "loss", "min_auc": "auc"}
MODEL_METRICS = {"cnn": ("loss", "accuracy"), "resnet": ("loss", "accuracy"),
                 "bert": ("loss", "accuracy"), "dlrm": ("loss", "accuracy", "auc")}

SECTION_ORDER = ("job", "strategy", "data", "model", "train", "monitor", "targets")

# --tiny: a few steps of a tiny model on tiny data (tests, smoke runs)
TINY = {
    "train": {"epochs": 1, "steps_per_epoch": 3, "eval_steps": 2, "warmup_epochs": 0.0,
              "precise_bn_batches": 2},
    # at most this many CPU replicas (unless --set strategy.cpu_replicas or TFDP_CPU_REPLICAS
    # says otherwise) and examples per global batch: tracing the step, once per replica,
    # dominates a tiny run
    "strategy": {"cpu_replicas": 2},
    "max_global_batch_size": 64,
    "monitor": {"baseline_steps": 3},
    "data": {"cifar10": {"train_examples": 1024, "eval_examples": 512},
             "digits": {},
             "synthetic_text": {"train_examples": 512, "eval_examples": 256, "vocab_size": 64},
             "interactions": {"num_files": 2, "examples_per_file": 256, "eval_files": 1,
                              "num_users": 500, "num_items": 1000}},
    "model": {"cnn": {"filters": 8, "dense_units": 16}, "resnet": {"depth": 8, "width": 4},
              "bert": {"layers": 1, "hidden": 16, "heads": 2, "intermediate": 32},
              "dlrm": {"embedding_dim": 4, "bottom_units": [8], "top_units": [8]}},
}
