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

The schema itself (checkers, keys, ``--tiny`` sizes) is :mod:`tfdp.train.config_schema`; this
module validates a file against it. Nothing here imports TensorFlow: a bad config fails in
milliseconds.
"""

from __future__ import annotations

import copy
import os
import tomllib
from dataclasses import dataclass
from typing import Any

from tfdp.errors import UsageError, message

# (the schema, re-exported: tfdp.train.config.SECTIONS, ALGORITHMS, ... as before)
from tfdp.train.config_schema import (  # noqa: F401
    ALGORITHMS, BUILDER_KEY, DATA_BUILDER_KEYS, DATA_COMMON, MODEL_BUILDER_KEYS, MODEL_COMMON,
    MODEL_METRICS, MODEL_SOURCES, MODELS, SECTION_ORDER, SECTIONS, SOURCES, TARGET_METRIC, TINY,
    Key, _Bad)


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
