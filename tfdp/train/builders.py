"""Your own model and data in ``tfdp train``: ``[model] builder`` and ``[data] builder``.

``builder = "package.module:function"``; every other key of the table is a keyword argument of
the function (``[data]`` keeps ``global_batch_size`` and ``shuffle_seed``, ``[model]`` keeps
``loss`` and ``metrics``). The config's folder and the working directory are importable, so a
``my_job.py`` next to ``my_job.toml`` is found as ``builder = "my_job:build_model"``.

``[model] builder``: ``function(**keys)`` is called inside the strategy's scope and returns a
Keras model (not compiled: ``tfdp train`` compiles it with the ``[train]`` optimizer and learning
rate), ``(model, loss)`` or ``(model, loss, metrics)``; a bare model takes ``[model] loss`` and
``metrics``. A dict ``{"model", "loss", "metrics", "weighted_metrics"}`` works too.

``[data] builder``, either style, told apart by the function's parameters:

* ``function(input_context, **keys)``: a ``tf.distribute.InputContext`` per input pipeline
  (``input_context.get_per_replica_batch_size(global_batch_size)``,
  ``input_context.num_input_pipelines`` / ``input_pipeline_id`` to shard); returns
  ``(train, eval)`` datasets batched PER REPLICA (``distribute_datasets_from_function``).
* ``function(global_batch_size, **keys)``: returns ``(train, eval)`` batched with the GLOBAL
  batch; the strategy splits every batch across the replicas (``experimental_distribute_dataset``,
  auto-sharded across workers).

The training set is repeated for the run; one pass is ``[train] steps_per_epoch`` or, when it is
not set, the training set's cardinality (it must then be finite and known). Evaluation runs the
whole evaluation set (or ``[train] eval_steps`` batches).

Errors name what is wrong, what was received and the fix: a module that does not exist, a
function that is not in it, keyword arguments the function does not take, a wrong return type.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys

from tfdp.errors import TfdpError, UsageError, message


def _add_paths(config_path: str) -> None:
    for folder in (os.path.dirname(os.path.abspath(config_path)) if config_path else None,
                   os.getcwd()):
        if folder and folder not in sys.path:
            sys.path.append(folder)


def _no_module(where, text, missing, config_path) -> UsageError:
    module_name = text.partition(":")[0]
    return UsageError(message(
        f"{where}: no module named {missing!r}", f"{where}={text!r}",
        f"Put {module_name.replace('.', '/')}.py next to the config "
        f"({os.path.dirname(os.path.abspath(config_path)) if config_path else '.'}) or in "
        "the working directory, or install its package."))


def _no_function(where, text, names, file) -> UsageError:
    module_name, _, attr = text.partition(":")
    return UsageError(message(
        f"{where}: module {module_name!r} has no function {attr!r}", f"{where}={text!r}",
        ("Functions defined there: " + ", ".join(names) + ".") if names else
        f"Define def {attr}(...) in {file}."))


def resolve(text: str, where: str, config_path: str = ""):
    """``"package.module:function"`` -> the function (``where``: ``"model.builder"``)."""
    module_name, _, attr = text.partition(":")
    _add_paths(config_path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise _no_module(where, text, missing, config_path) from None
        raise TfdpError(message(f"{where}: importing {module_name!r} failed",
                                f"{type(e).__name__}: {e}",
                                "Fix the import inside that module.")) from e
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items()
                        if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise _no_function(where, text, public, getattr(module, "__file__", module_name))
    if not callable(fn):
        raise UsageError(message(f"{where}: {text!r} is not a function", f"{type(fn).__name__}",
                                 "Point it at a function."))
    return fn


def check_kwargs(fn, kwargs: dict, where: str, text: str, passed=()):
    """Fail with one line when ``fn`` does not take ``kwargs`` (+ the ``passed`` names)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    section = where.split(".")[0]
    unknown = [k for k in kwargs if k not in takes]
    if unknown:
        raise UsageError(message(
            f"{where}: {text} does not take {', '.join(repr(k) for k in unknown)}",
            ", ".join(f"{section}.{k}={kwargs[k]!r}" for k in unknown),
            "Its parameters: " + (", ".join(takes) or "none") + ". Remove the key or add the "
            "parameter."))
    missing = [n for n, p in params.items() if p.default is p.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and n not in kwargs and n not in passed]
    if missing:
        raise UsageError(message(
            f"{where}: {text} needs {', '.join(repr(k) for k in missing)}",
            f"[{section}] without " + ", ".join(missing),
            f"Add them to [{section}] (e.g. {missing[0]} = ...) or give them defaults."))


# --- model --------------------------------------------------------------------------------------

def build_model(model_cfg: dict, config_path: str = ""):
    """Call ``[model] builder``; returns ``(model, loss, metrics, weighted_metrics)``."""
    import keras
    text, kwargs = model_cfg["builder"], dict(model_cfg["kwargs"])
    fn = resolve(text, "model.builder", config_path)
    check_kwargs(fn, kwargs, "model.builder", text)
    out = fn(**kwargs)
    loss, metrics, weighted = model_cfg.get("loss"), model_cfg.get("metrics"), None
    got = out
    if isinstance(out, dict):
        unknown = set(out) - {"model", "loss", "metrics", "weighted_metrics"}
        if "model" not in out or unknown:
            raise _bad_model_return(text, out)
        got = out["model"]
        loss = out.get("loss", loss)
        metrics = out.get("metrics", metrics)
        weighted = out.get("weighted_metrics")
    elif isinstance(out, (tuple, list)):
        if not 2 <= len(out) <= 3:
            raise _bad_model_return(text, out)
        got, loss = out[0], out[1]
        metrics = out[2] if len(out) == 3 else metrics
    if not isinstance(got, keras.Model):
        raise _bad_model_return(text, out)
    if loss is None:
        raise TfdpError(message(
            f"model.builder: {text} returned a model without a loss", "loss=None",
            'Return (model, loss) or (model, loss, metrics), or set [model] loss = '
            '"sparse_categorical_crossentropy" (any Keras loss name).'))
    return got, loss, metrics, weighted


def _bad_model_return(text, out):
    return TfdpError(message(
        f"model.builder: {text} returned the wrong type",
        f"{type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""),
        "Return a keras.Model, (model, loss), (model, loss, metrics) or a dict with 'model' "
        "(and 'loss', 'metrics', 'weighted_metrics')."))


# --- data ---------------------------------------------------------------------------------------

def _datasets(out, text, style):
    import tensorflow as tf
    if isinstance(out, dict) and set(out) == {"train", "eval"}:
        out = (out["train"], out["eval"])
    if (not isinstance(out, (tuple, list)) or len(out) != 2
            or not all(isinstance(d, tf.data.Dataset) for d in out)):
        kind = type(out).__name__
        if isinstance(out, (tuple, list)):
            kind += " of (" + ", ".join(type(d).__name__ for d in out) + ")"
        raise TfdpError(message(
            f"data.builder: {text} returned the wrong type", kind,
            f"Return (train, eval): two tf.data.Dataset objects batched {style} (or a dict with "
            "'train' and 'eval')."))
    return out


class _Declared:
    """A builder function as its module's source declares it (read, not imported): its
    signature, for the checks that need no TensorFlow."""

    def __init__(self, signature):
        self.__signature__ = signature

    def __call__(self, *args, **kwargs):   # (inspect.signature wants a callable)
        raise TypeError("a declaration, not the function")


def _signature(fn: ast.FunctionDef) -> inspect.Signature:
    a, P = fn.args, inspect.Parameter
    params = []
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=None if i >= first_default else P.empty))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if default is None else None))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _top_level_names(body, functions, others) -> bool:
    """Collect the names a module binds at top level; False if it cannot be told (``import *``,
    a module ``__getattr__``)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == "__getattr__":
                return False
            (others if node.name in functions or node.decorator_list else functions)[
                node.name] = node
        elif isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return False
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                others[(a.asname or a.name).split(".")[0]] = node
        elif isinstance(node, ast.ClassDef):
            others[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            for target in ast.walk(node):
                if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                    others[target.id] = node
        elif isinstance(node, (ast.If, ast.Try)):
            for block in ([node.body, node.orelse] + ([node.finalbody] + [
                    h.body for h in node.handlers] if isinstance(node, ast.Try) else [])):
                if not _top_level_names(block, others, others):
                    return False
    return True


def declared(text: str, where: str, config_path: str = ""):
    """What ``"module:function"`` is, from the module's source, without importing the module
    (so without TensorFlow): a stand-in with the function's signature, or None when the source
    cannot tell (a compiled module, a decorated or assigned function, ``import *``).

    Raises:
      UsageError: no such module, or the module defines no such name.
    """
    module_name, _, attr = text.partition(":")
    _add_paths(config_path)
    try:
        spec = importlib.util.find_spec(module_name)
    except ModuleNotFoundError as e:   # a parent package is missing
        raise _no_module(where, text, e.name or module_name, config_path) from None
    except (ImportError, ValueError):   # a parent package failed to import: said at the run
        return None
    if spec is None:
        raise _no_module(where, text, module_name, config_path)
    origin = spec.origin or ""
    if not origin.endswith(".py") or not os.path.isfile(origin):
        return None
    try:
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), origin)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None   # (importing it says what is wrong, at the run)
    functions, others = {}, {}
    if not _top_level_names(tree.body, functions, others):
        return None
    if attr in others:
        return None
    if attr not in functions:
        defined = {**others, **functions}
        public = sorted(n for n, node in defined.items() if not n.startswith("_")
                        and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
        raise _no_function(where, text, public, origin)
    return _Declared(_signature(functions[attr]))


def precheck(cfg) -> None:
    """Check ``[model] builder`` and ``[data] builder`` without calling them, before TensorFlow
    starts: the module imports, the function exists, it takes the table's keys (and, for data,
    ``input_context`` or ``global_batch_size``). Raises the same one-line errors as the run."""
    m = cfg["model"]
    if "builder" in m:
        fn = declared(m["builder"], "model.builder", cfg.path)
        if fn is not None:
            check_kwargs(fn, dict(m["kwargs"]), "model.builder", m["builder"])
    if "builder" in cfg["data"]:
        fn = declared(cfg["data"]["builder"], "data.builder", cfg.path)
        if fn is not None:
            _data_function(cfg, fn)


def _data_function(cfg, fn=None):
    """``[data] builder``: (function, its parameters, style, keyword arguments), checked
    (``fn``: the function or its declaration; default: the imported function)."""
    d = cfg["data"]
    text, kwargs = d["builder"], dict(d["kwargs"])
    fn = resolve(text, "data.builder", cfg.path) if fn is None else fn
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "input_context" in params:
        style = "input_context"
    elif "global_batch_size" in params:
        style = "global_batch_size"
    else:
        raise UsageError(message(
            f"data.builder: {text} takes neither input_context nor global_batch_size",
            f"parameters ({', '.join(params)})",
            "Define it as def f(input_context, ...) (per-replica batches) or "
            "def f(global_batch_size, ...) (global batches)."))
    for reserved in ("input_context", "global_batch_size"):
        if reserved in kwargs:
            raise UsageError(message(
                f"data.{reserved} is passed by tfdp train", f"data.{reserved}={kwargs[reserved]!r}",
                "Remove it from [data] (global_batch_size is tfdp's own [data] key)."))
    for reserved in ("shuffle_seed",):
        if reserved in kwargs:
            raise UsageError(message(
                f"data.{reserved} is tfdp's own key", f"data.{reserved}={kwargs[reserved]!r}",
                "It is passed to the function when the function takes it."))
    check_kwargs(fn, kwargs, "data.builder", text,
                 passed=(style, "global_batch_size", "shuffle_seed"))
    return fn, params, style, kwargs


def build_data(cfg):
    """A :class:`tfdp.train.inputs.Data` from ``[data] builder``."""
    import tensorflow as tf

    from tfdp.train.inputs import Data
    d = cfg["data"]
    text = d["builder"]
    fn, params, style, kwargs = _data_function(cfg)
    if "shuffle_seed" in params:
        kwargs["shuffle_seed"] = d["shuffle_seed"]
    wants_gbs = "global_batch_size" in params and style == "input_context"
    per = "per replica" if style == "input_context" else "with the global batch size"

    def call(**extra):
        if wants_gbs:
            extra["global_batch_size"] = d["global_batch_size"]
        return _datasets(fn(**extra, **kwargs), text, per)

    cache = {}

    def pair(strategy, global_batch_size):
        """(train, eval) distributed datasets, built once per strategy."""
        key = (id(strategy), global_batch_size)
        if key not in cache:
            if style == "input_context":
                made = {}

                def from_ctx(which):
                    def ds_fn(ctx):
                        if ctx.input_pipeline_id not in made:
                            made[ctx.input_pipeline_id] = call(input_context=ctx)
                        return made[ctx.input_pipeline_id][which]
                    return ds_fn
                train = strategy.distribute_datasets_from_function(
                    lambda ctx: from_ctx(0)(ctx).repeat())
                ev = strategy.distribute_datasets_from_function(from_ctx(1))
                first = made[min(made)]
                local = len(strategy.extended.worker_devices) // max(1, len(made))
                steps = _cardinality(first[0]) // max(1, local) \
                    if _cardinality(first[0]) is not None else None
            else:
                tr, ev_ds = call(global_batch_size=global_batch_size)
                steps = _cardinality(tr)
                train = strategy.experimental_distribute_dataset(tr.repeat())
                ev = strategy.experimental_distribute_dataset(ev_ds)
            cache[key] = (train, ev, steps)
        return cache[key]

    def train(strategy, global_batch_size, shuffle_seed):   # your function shuffles
        return pair(strategy, global_batch_size)[0]

    def evaluate(strategy, global_batch_size):
        return pair(strategy, global_batch_size)[1]

    def steps(strategy, global_batch_size):
        return pair(strategy, global_batch_size)[2]

    def local(batch_size):
        """Non-distributed training batches of ``batch_size`` (baseline, precise BN)."""
        if style == "input_context":
            ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                             num_replicas_in_sync=1)
            if wants_gbs:
                return _datasets(fn(input_context=ctx, global_batch_size=batch_size, **kwargs),
                                 text, per)[0].repeat()
            # the function batches with the configured global batch: per replica = all of it
            return call(input_context=ctx)[0].unbatch().batch(batch_size).repeat()
        return call(global_batch_size=batch_size)[0].repeat()

    name = text
    data = Data(name, f"{text}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}): your "
                f"datasets, batched {per}", False, None, None, {}, train, evaluate, local)
    data.steps = steps
    return data


def _cardinality(ds):
    import tensorflow as tf
    n = int(ds.cardinality())
    if n in (int(tf.data.INFINITE_CARDINALITY), int(tf.data.UNKNOWN_CARDINALITY)):
        return None
    return n
