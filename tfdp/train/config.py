"""``tfdp train`` configs: a TOML file (stdlib ``tomllib``) validated against one schema.

Sections and keys (every key is checked; an unknown or mistyped key is an error naming the key
and listing the valid ones, so a typo never passes silently)::

    [job]       name, seed
    [strategy]  cpu_replicas, all_reduce, bucket_bytes, compression, zero_stage
    [data]      source + the keys of that source (see SOURCES), global_batch_size, shuffle_seed;
                or builder = "module:function" + that function's keyword arguments
    [model]     kind + the keys of that kind (see MODELS);
                or builder = "module:function" + that function's keyword arguments (+ loss, metrics)
    [train]     epochs, steps_per_epoch, eval_steps, optimizer, learning_rate, momentum,
                weight_decay, lr_scaling, base_batch_size, warmup_epochs, schedule,
                precise_bn_batches
    [monitor]   log_dir, allreduce_estimate, scaling_baseline, baseline_steps, stragglers
    [targets]   min_accuracy, max_loss, min_auc, max_step_time_ms, min_examples_per_sec,
                min_scaling_efficiency

Nothing here imports TensorFlow: a bad config fails in milliseconds.
"""

from __future__ import annotations

import copy
import math
import os
import tomllib
from dataclasses import dataclass
from typing import Any, Callable

from tfdp.errors import UsageError, message

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


@dataclass
class Config:
    """A validated config: ``sections[name][key]`` with every default filled in."""

    path: str
    sections: dict
    tiny: bool = False
    cli_targets: tuple = ()     # target keys given with --set (still checked with --tiny)
    cli_keys: tuple = ()        # every "section.key" given with --set (arguments win)
    cpu_replicas_why: str | None = None   # set by the run: where the CPU replica count came from

    def __getitem__(self, section):
        return self.sections[section]

    @property
    def name(self) -> str:
        return self.sections["job"]["name"]

    @property
    def targets(self) -> dict:
        """The targets to check: all of them, or with --tiny only those given by --set."""
        t = self.sections["targets"]
        if self.tiny:
            return {k: v for k, v in t.items() if k in self.cli_targets}
        return dict(t)

    def to_dict(self) -> dict:
        return copy.deepcopy(self.sections)


def _where(path, key=None, given=None):
    """Where a value came from: `` (--set train.epochs=abc)`` for a key given on the command
    line, else `` in configs/x.toml``."""
    if key is not None and given and key in given:
        return f" (given by --set {given[key]})"
    return f" in {path}" if path else ""


def _unknown(kind: str, name: str, valid, path, how=""):
    return UsageError(message(f"Unknown {kind}{_where(path)}{how}", name,
                              "Valid: " + ", ".join(valid) + "."))


def _type_name(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "a table"}.get(type(v), type(v).__name__)


def _check_section(name, raw, keys: dict[str, Key], path, out, where_keys=None, given=None):
    valid = list(where_keys or keys)
    for k, v in raw.items():
        if k not in keys:
            if given and f"{name}.{k}" in given:
                raise _unknown("key", f"{name}.{k}", [f"{name}.{x}" for x in valid], "",
                               how=f" given by --set {given[f'{name}.{k}']}")
            raise _unknown("key", f"{name}.{k}", [f"{name}.{x}" for x in valid], path)
        try:
            out[k] = keys[k].check(v)
        except _Bad as e:
            raise UsageError(message(f"Invalid {name}.{k}{_where(path, f'{name}.{k}', given)}",
                                     f"{name}.{k}={v!r} ({_type_name(v)})",
                                     f"Expected {e.expected}.")) from None
    for k, spec in keys.items():
        if k not in out:
            if spec.required:
                raise UsageError(message(f"Missing {name}.{k}{_where(path)}",
                                         f"[{name}] without {k!r}",
                                         f"Add it, e.g. {_example(name, k, spec)}."))
            out[k] = copy.deepcopy(spec.default)


def _example(section, key, spec):
    choices = getattr(spec.check, "choices", None)
    if choices:
        return f'[{section}] {key} = "{choices[0]}"'
    return f"[{section}] {key} = 256" if key == "global_batch_size" else f"[{section}] {key} = ..."


def validate(raw: dict, path: str = "", *, tiny: bool = False, cli_targets=(),
             cli_keys=(), given=None) -> Config:
    """Check a parsed TOML document against the schema; fill in defaults. ``given`` maps the
    ``"section.key"`` values that came from ``--set`` to their text (errors then name --set)."""
    if not isinstance(raw, dict):
        raise UsageError(message("A config must be a TOML table", repr(raw), "See configs/."))
    for name, value in raw.items():
        if name not in SECTION_ORDER:
            raise _unknown("section", f"[{name}]" if isinstance(value, dict) else name,
                           [f"[{s}]" for s in SECTION_ORDER], path)
        if not isinstance(value, dict):
            raise UsageError(message(f"Invalid [{name}]{_where(path)}", f"{name}={value!r}",
                                     f"Expected a table: [{name}] followed by key = value lines."))
    sections = {}
    for name in SECTION_ORDER:
        body = raw.get(name, {})
        out = {}
        if name in ("data", "model") and BUILDER_KEY in body:
            _check_builder_section(name, body, path, out, given)
        elif name == "data":
            src = body.get("source")
            if src is None:
                raise UsageError(message(f"Missing data.source{_where(path)}",
                                         "[data] without 'source'",
                                         'Add e.g. [data] source = "digits" (valid: '
                                         + ", ".join(repr(s) for s in SOURCES) + ') or your '
                                         'own [data] builder = "module:function".'))
            _check_section(name, {"source": src}, {"source": DATA_COMMON["source"]}, path, out,
                           given=given)
            keys = {**DATA_COMMON, **SOURCES[out["source"]]}
            _check_section(name, body, keys, path, out, given=given)
        elif name == "model":
            kind = body.get("kind")
            if kind is None:
                raise UsageError(message(f"Missing model.kind{_where(path)}",
                                         "[model] without 'kind'",
                                         'Add e.g. [model] kind = "cnn" (valid: '
                                         + ", ".join(repr(s) for s in MODELS) + ') or your '
                                         'own [model] builder = "module:function".'))
            _check_section(name, {"kind": kind}, MODEL_COMMON, path, out, given=given)
            _check_section(name, body, {**MODEL_COMMON, **MODELS[out["kind"]]}, path, out,
                           given=given)
        else:
            _check_section(name, body, SECTIONS[name], path, out, given=given)
        sections[name] = out
    if sections["job"]["name"] is None:
        sections["job"]["name"] = os.path.splitext(os.path.basename(path))[0] if path else "job"
    kind, source = sections["model"].get("kind"), sections["data"].get("source")
    if kind is not None and source is not None and source not in MODEL_SOURCES[kind]:
        raise UsageError(message(f"model.kind {kind!r} cannot train on data.source {source!r}"
                                 f"{_where(path)}", f"model.kind={kind!r}, data.source={source!r}",
                                 f"Valid sources for {kind!r}: "
                                 + ", ".join(repr(s) for s in MODEL_SOURCES[kind]) + "."))
    for t, v in sections["targets"].items():
        metric = TARGET_METRIC.get(t)
        if v is not None and metric and kind is not None and metric not in MODEL_METRICS[kind]:
            raise UsageError(message(f"targets.{t} needs the metric {metric!r}, which model.kind "
                                     f"{kind!r} does not report{_where(path)}", f"targets.{t}={v}",
                                     "Metrics of this model: "
                                     + ", ".join(MODEL_METRICS[kind]) + "."))
    sections["targets"] = {k: v for k, v in sections["targets"].items() if v is not None}
    if "min_scaling_efficiency" in sections["targets"] and not sections["monitor"][
            "scaling_baseline"] and not tiny:
        sections["monitor"]["scaling_baseline"] = True  # the target needs the baseline
    cfg = Config(path=path, sections=sections, tiny=tiny, cli_targets=tuple(cli_targets),
                 cli_keys=tuple(cli_keys))
    if tiny:
        _apply_tiny(cfg, raw)
    return cfg


def _apply_tiny(cfg: Config, raw: dict):
    s = cfg.sections
    for k, v in TINY["train"].items():
        if k == "steps_per_epoch" and s["train"]["steps_per_epoch"] is not None:
            v = min(v, s["train"]["steps_per_epoch"])
        s["train"][k] = v
    s["monitor"].update(TINY["monitor"])
    if "strategy.cpu_replicas" not in cfg.cli_keys:
        s["strategy"]["cpu_replicas"] = min(s["strategy"]["cpu_replicas"],
                                            TINY["strategy"]["cpu_replicas"])
    if "data.global_batch_size" not in cfg.cli_keys:
        s["data"]["global_batch_size"] = min(s["data"]["global_batch_size"],
                                             TINY["max_global_batch_size"])
    if "source" in s["data"]:
        s["data"].update(TINY["data"][s["data"]["source"]])
    if "kind" in s["model"]:
        s["model"].update(TINY["model"][s["model"]["kind"]])


def _check_builder_section(name, body, path, out, given=None):
    """``[data]`` / ``[model]`` with ``builder``: tfdp's own keys are checked here; every other
    key is a keyword argument of the function (checked against its signature at run time)."""
    keys = DATA_BUILDER_KEYS if name == "data" else MODEL_BUILDER_KEYS
    other = "source" if name == "data" else "kind"
    if other in body:
        raise UsageError(message(f"[{name}] has both {other!r} and 'builder'{_where(path)}",
                                 f"{name}.{other}={body[other]!r}, {name}.builder="
                                 f"{body['builder']!r}", f"Keep one: a built-in {other} or your "
                                 "own builder."))
    own = {k: v for k, v in body.items() if k in keys}
    _check_section(name, own, keys, path, out, given=given)
    text = out["builder"]
    mod, _, fn = text.partition(":")
    if not mod or not fn or not all(p.isidentifier() for p in mod.split(".") + [fn]):
        raise UsageError(message(f"Invalid {name}.builder{_where(path, f'{name}.builder', given)}",
                                 f"{name}.builder={text!r}", 'Use "package.module:function", '
                                 'e.g. builder = "my_models:build" (a my_models.py next to the '
                                 "config or in the working directory)."))
    out["kwargs"] = {k: copy.deepcopy(v) for k, v in body.items() if k not in keys}


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"train.epochs=3"`` -> ``("train", "epochs", 3)`` (the value is parsed as TOML; a bare
    word is a string)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UsageError(message("Invalid --set", repr(text),
                                 "Use --set SECTION.KEY=VALUE, e.g. --set train.epochs=3 or "
                                 "--set data.source=cifar10."))
    dotted, value = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    value = value.strip()
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return section, key.strip(), parsed


def load(path: str, overrides=(), *, tiny: bool = False) -> Config:
    """Read, override (``--set`` strings) and validate a TOML config file."""
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        have = sorted(f for f in os.listdir(folder) if f.endswith(".toml")) \
            if os.path.isdir(folder) else []
        fix = ("Available in " + folder + ": " + ", ".join(have) + ".") if have else \
            "Pass the path of a TOML config, e.g. configs/quickstart.toml."
        raise UsageError(message("Config file not found", repr(path), fix))
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(message(f"Invalid TOML in {path}", str(e),
                                 "Fix the syntax (https://toml.io).")) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(message("Cannot read the config", f"{path!r} ({e})",
                                 "Pass a readable UTF-8 TOML file.")) from None
    cli_targets, cli_keys, given = [], [], {}
    for text in overrides:
        section, key, value = parse_override(text)
        given[f"{section}.{key}"] = text.strip()
        if section not in SECTION_ORDER:
            raise _unknown("section", section, list(SECTION_ORDER), "", how=" given by --set")
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise UsageError(message(f"Invalid [{section}] in {path}", repr(table),
                                     "Expected a table."))
        table[key] = value
        cli_keys.append(f"{section}.{key}")
        if section == "targets":
            cli_targets.append(key)
    return validate(raw, path, tiny=tiny, cli_targets=cli_targets, cli_keys=cli_keys,
                    given=given)


def describe_schema() -> str:
    """The schema as text (``tfdp train --keys``)."""
    lines = []

    def add(title, keys):
        lines.append(title)
        for k, spec in keys.items():
            choices = getattr(spec.check, "choices", None)
            dflt = "required" if spec.required else (
                "optional" if spec.default is None else f"default {spec.default!r}")
            extra = (" (" + "|".join(choices) + ")") if choices else ""
            lines.append(f"  {k:<22} {spec.check.kind}{extra}; {dflt}"
                         + (f": {spec.help}" if spec.help else ""))
    for name in SECTION_ORDER:
        if name == "data":
            add("[data]", DATA_COMMON)
            for src, keys in SOURCES.items():
                add(f"[data] source = {src!r}", keys)
            add("[data] builder = \"module:function\" (+ the function's keyword arguments)",
                DATA_BUILDER_KEYS)
        elif name == "model":
            add("[model]", MODEL_COMMON)
            for kind, keys in MODELS.items():
                add(f"[model] kind = {kind!r}", keys)
            add("[model] builder = \"module:function\" (+ the function's keyword arguments)",
                MODEL_BUILDER_KEYS)
        else:
            add(f"[{name}]", SECTIONS[name])
    return "\n".join(lines)
