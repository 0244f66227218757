"""tfdp's Keras adapter: every hook tfdp puts into Keras (and TensorFlow, and Python's
``sys.excepthook``), in one table, present only while something of tfdp uses it.

A hook set is a group of wrappers (``tfdp.compat.wrap``; ``tfdp.compat.unwrap`` takes them out
and puts Keras's own functions back exactly). The table below is every set: where it wraps and
who uses it; the module that owns a set's hooks provides them when it is imported
(``provide``; the adapter imports none of them). Each set is counted by its users, weakly held
objects: ``use(owner, *sets)`` installs the sets the first user needs, and they are removed when
the last user is garbage-collected or released (``release(owner)``). Nothing of tfdp is in Keras
in a process that imported tfdp without creating a strategy, or once its strategies are gone
(``tests/test_adapter_scope.py`` compares such processes with one that never imported tfdp).

=================== ========================================= ========================= ==========
set                 what it wraps                             used by                   if a name
                                                                                        is missing
=================== ========================================= ========================= ==========
``gradient_path``   loss scale/unscale, reduce_weighted_      every tfdp strategy       refused
                    values, Mean.update_state, GradientTape.
                    gradient, optimizer apply (also the loss-
                    scale wrapper's), _clip_gradients,
                    _all_reduce_sum_gradients, _make_function,
                    Model.predict_on_batch / get_metrics_
                    result (``tfdp.keras.gradient_path``,
                    ``losses``, ``reported``)
``symbolic_build``  _maybe_symbolic_build (an unbuilt model   every tfdp strategy       off
                    built from the element spec)
``perf``            Keras's TF ``take``, ``SGD.build``        every tfdp strategy       off
                    (sparse embedding reads)
``zero``            optimizer build, _backend_apply_          a strategy with           off
                    gradients, apply (``tfdp.zero.hooks``)    zero_stage (first use)
``input_position``  TFEpochIterator __init__ / _get_iterator  tfdp's BackupAndRestore   off
                    (``tfdp.callbacks.input_position``)       callback, while it lives
``shared_files``    Keras's BackupAndRestore / Model-         a multi-worker strategy   off
                    Checkpoint / CSVLogger writers
                    (``tfdp.callbacks.shared_files``)
``peer_failure``    ``sys.excepthook`` (``tfdp.failures``)    a multi-worker strategy   (public)
``device_alias``    the eager context's ``device`` (former    a multi-worker strategy   refused
                    local device names, ``tfdp.compat.        whose collective runtime
                    former_local_device_alias``)              started late
=================== ========================================= ========================= ==========

The last column: what tfdp does when the installed TF / Keras lacks a name the set needs (its
feature in ``tfdp.compat.names.FEATURES``): an essential set is refused with one line when the
strategy is created; an extra is left out with one warning saying what the user loses, and
Keras's own code runs (training stays exact).

Each wrapper calls Keras's own code whenever no tfdp step is involved (no strategy, another
strategy, one replica), so a function Keras traced while a tfdp strategy existed and traces again
later behaves as Keras's. Keras calls every wrapped point through its owner (a module global or a
class attribute looked up at call time: ``loss_module.scale_loss_for_distribution``,
``backend.numpy.take``, methods), so installing and removing reaches every caller.

Finalizers may run inside any allocation (garbage collection): a release that finds the table
busy is queued and done by the thread holding it, before it lets go.
"""

from __future__ import annotations

import sys
import threading
import weakref

from tfdp import compat as tfp


class HookSet:
    """A group of wrappers at ``points()`` ({name: (owner, attribute)}) under one ``marker``; the
    module that owns the hooks provides them (``provide``: {name: make(original) ->
    replacement}, and optionally its own install / remove). ``feature``: the feature of
    ``tfdp.compat.names`` whose names it needs (None: public names only)."""

    def __init__(self, name, points, marker, feature=None):
        self.name, self._points, self.marker = name, points, marker
        self.feature = feature
        self.hooks = None                    # set by provide()
        self._install = self._remove = None  # (a module's own install / remove)

    def points(self):
        return self._points()

    def install(self) -> None:
        if self.hooks is None:
            raise RuntimeError(f"tfdp: hook set {self.name!r} used before its module provided "
                               "its hooks")
        if self._install is not None:
            self._install()
        else:
            tfp.wrap(self._points(), self.hooks, self.marker)

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
        else:
            tfp.unwrap(self._points(), list(self.hooks), self.marker)

    def installed(self) -> list[str]:
        """The names of this set's points that carry its wrapper now."""
        return tfp.wrapped(self._points(), self.marker)


def provide(name, hooks, install=None, remove=None) -> None:
    """Called by the module that owns hook set ``name`` when it is imported (the adapter imports
    none of them): its hooks, and optionally its own install / remove (which must wrap and unwrap
    exactly these hooks)."""
    hook_set = SETS[name]
    hook_set.hooks = dict(hooks)
    hook_set._install, hook_set._remove = install, remove


def _subset(points, names):
    return lambda: {n: p for n, p in points().items() if n in names}


def _peer_failure_points():
    return {"excepthook": (sys, "excepthook")}


def _device_alias_points():
    return {"device": (tfp.eager_context(), "device")}


def _points(name):
    return lambda: getattr(tfp, name)()  # (tfdp.compat loads TensorFlow only when called)


_CALLBACK_MARKER = "__tfdp_callbacks_original__"
SETS = {s.name: s for s in (
    HookSet("gradient_path", _points("keras_hook_points"), "__tfdp_original__",
            "gradient_path"),
    HookSet("symbolic_build", _points("keras_symbolic_build_points"), "__tfdp_original__",
            "symbolic_build"),
    HookSet("perf", _points("keras_perf_hook_points"), "__tfdp_original__", "sparse_reads"),
    HookSet("zero", _points("keras_zero_hook_points"), "__tfdp_zero_original__", "zero"),
    HookSet("input_position",
            _subset(_points("keras_callbacks_hook_points"),
                    ("epoch_iterator_init", "epoch_iterator_get_iterator")), _CALLBACK_MARKER,
            "input_position"),
    HookSet("shared_files",
            _subset(_points("keras_callbacks_hook_points"),
                    ("backup_save", "backup_train_end", "checkpoint_save", "csv_train_begin")),
            _CALLBACK_MARKER, "shared_files"),
    HookSet("peer_failure", _peer_failure_points, "__tfdp_peer_failure_original__"),
    HookSet("device_alias", _device_alias_points, "__tfdp_device_alias_original__",
            "multi_worker"),
)}
STRATEGY_SETS = ("gradient_path", "symbolic_build", "perf")  # what every tfdp strategy uses

_lock = threading.Lock()
_users: dict[str, int] = {}   # set name -> live users
_leases: dict[int, list] = {}  # id(owner) -> its weakref.finalize objects
_pending: list = []           # releases queued while the table was busy


def use(owner, *names) -> list[str]:
    """Install the hook sets ``names`` (those not installed yet) for as long as ``owner`` lives,
    or until ``release(owner)``; returns the names in use. A set whose feature the installed
    TF / Keras cannot provide (``tfdp.compat.names.require``) is refused when essential, else
    left out with one warning (its feature is off; Keras's own code runs). A set that fails to
    install raises and counts no user."""
    for name in names:
        if name not in SETS:
            raise KeyError(f"no hook set {name!r} (known: {sorted(SETS)})")
    from tfdp.compat import names as private_names
    off = private_names.require(*{SETS[n].feature for n in names if SETS[n].feature})
    names = tuple(n for n in names if SETS[n].feature not in off)
    if not names:
        return []
    with _lock:
        counted = []
        try:
            for name in names:
                if not _users.get(name):
                    SETS[name].install()
                _users[name] = _users.get(name, 0) + 1
                counted.append(name)
        except BaseException:
            _release_now(counted)
            raise
        lease = weakref.finalize(owner, _release, tuple(names), id(owner))
        lease.atexit = False  # (the process is ending: nothing to put back)
        _leases.setdefault(id(owner), []).append(lease)
    _drain()
    return list(names)


def release(owner) -> None:
    """Release every hook set ``owner`` uses now (as its garbage collection would)."""
    with _lock:
        leases = list(_leases.get(id(owner), ()))
    _drain()  # (a finalizer that ran meanwhile found the table busy)
    for lease in leases:
        lease()


def held_by(owner) -> set[str]:
    """The hook sets ``owner`` holds now (through ``use``)."""
    with _lock:
        leases = list(_leases.get(id(owner), ()))
    held = set()
    for lease in leases:
        info = lease.peek()  # (obj, func, args, kwargs) while alive
        if info is not None:
            held.update(info[2][0])
    return held


def users(name) -> int:
    """How many live users hold the hook set ``name``."""
    return _users.get(name, 0)


def installed() -> dict[str, list[str]]:
    """{set: names of its points wrapped now} for every set with a wrapper in place."""
    out = {}
    for name, hook_set in SETS.items():
        try:
            names = hook_set.installed()
        except Exception:  # noqa: BLE001 - (the eager context may not exist yet)
            names = []
        if names:
            out[name] = names
    return out


def _release(names, owner_id) -> None:
    _pending.append((names, owner_id))
    _drain()


def _drain() -> None:
    while _pending:
        if not _lock.acquire(blocking=False):
            return  # the thread holding the table drains before it lets go (use's last line)
        try:
            while _pending:
                names, owner_id = _pending.pop()
                leases = _leases.get(owner_id)
                if leases is not None:
                    leases[:] = [lease for lease in leases if lease.alive]
                    if not leases:
                        del _leases[owner_id]
                _release_now(names)
        finally:
            _lock.release()


def _release_now(names) -> None:
    for name in reversed(names):
        _users[name] = _users.get(name, 0) - 1
        if _users[name] <= 0:
            _users.pop(name, None)
            SETS[name].remove()


def use_device_alias(owner, make) -> None:
    """Install ``make`` (make(Context.device bound method) -> replacement) as the eager context's
    ``device`` for as long as ``owner`` lives (``device_alias``; one alias per process: the
    first one in force stays while any owner lives)."""
    with _lock:
        if not _users.get("device_alias"):
            provide("device_alias", {"device": make})
    _drain()
    use(owner, "device_alias")


__all__ = ["HookSet", "SETS", "STRATEGY_SETS", "held_by", "installed", "provide", "release", "use",
           "use_device_alias", "users"]
