"""Local devices: logical CPU replicas and device-list validation.

``TFDP_CPU_REPLICAS=n`` asks for ``n`` logical CPU devices. TensorFlow fixes its devices when its
runtime starts (the first op, dataset, device listing or variable), which in a script may come
long before the strategy is created (seeds, datasets, tensors). So the variable is applied as
early as tfdp can: when ``tfdp`` is imported (if TensorFlow is already imported and its runtime
has not started), else right after ``tensorflow`` itself is imported (a one-shot import hook,
so ``import tfdp`` alone, e.g. the ``tfdp`` command line, never imports TensorFlow). A runtime
that started before ``import tfdp`` cannot be split any more: the strategy then says so in one
line (:func:`apply_cpu_replicas_env`).

Precedence (the same everywhere in tfdp): arguments > environment > config defaults. An explicit
``tfdp.configure_cpu_replicas(n)`` in the program wins over ``TFDP_CPU_REPLICAS``, which was
already applied at import: the call re-splits the CPU (the runtime has not started) and logs one
line saying that it overrides the variable; the strategy then keeps the call's count. When the
runtime has already started with the variable's count, the call cannot win and raises one line
saying so. ``tfdp train``: ``--set strategy.cpu_replicas=n`` > ``TFDP_CPU_REPLICAS`` > the config
file's ``[strategy] cpu_replicas``.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys

from tfdp.errors import TfdpError, UsageError, invalid_argument, message

log = logging.getLogger("tfdp")

CPU_REPLICAS_ENV = "TFDP_CPU_REPLICAS"


def configure_cpu_replicas(n: int) -> list[str]:
    """Split the host CPU into ``n`` logical devices (``/device:CPU:0`` .. ``CPU:n-1``).

    Must run before the TensorFlow runtime initialises (before the first op, device listing or
    variable). Calling it again with the same ``n`` is a no-op. Returns the logical CPU names.

    Raises:
      TfdpError: ``n`` is not a positive int, or the runtime already started with another count.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise invalid_argument("n", n, fix="Pass a positive int: the number of CPU replicas, "
                               "e.g. configure_cpu_replicas(4).")
    import tensorflow as tf

    # Neither call below starts the runtime (listing *logical* devices would).
    names = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    _explicit["n"] = n
    env_n = _env_count()
    if current is not None and len(current) == n:
        return names
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == n:
            return [d.name for d in tf.config.list_logical_devices("CPU")]
        _explicit["n"] = None
        if env_n is not None and env_n == have:
            raise TfdpError(message(
                f"configure_cpu_replicas({n}) came too late to override {CPU_REPLICAS_ENV}="
                f"{env_n}: the variable was applied when tfdp was imported and the TensorFlow "
                f"runtime has started since with {have} logical CPU device(s)",
                f"n={n}, {CPU_REPLICAS_ENV}={env_n}",
                f"Call tfdp.configure_cpu_replicas({n}) before any TensorFlow op, dataset or "
                f"model is created (an explicit call wins over the variable), or set "
                f"{CPU_REPLICAS_ENV}={n} (tfdp launch --cpu-replicas {n}), or unset it.")) from None
        raise TfdpError(
            f"configure_cpu_replicas({n}) came too late: the TensorFlow runtime is already "
            f"initialised. Received: n={n} with {have} logical CPU device(s) already in use. "
            "Call tfdp.configure_cpu_replicas() (or set TFDP_CPU_REPLICAS) at the very start of "
            "the program, before any TensorFlow op, device listing or model is created.") from None
    if env_n is not None and env_n != n:
        log.warning("tfdp: configure_cpu_replicas(%d) overrides %s=%d: the host CPU is split "
                    "into %d logical devices (an explicit call wins over the environment)",
                    n, CPU_REPLICAS_ENV, env_n, n)
    else:
        log.debug("tfdp: host CPU split into %d logical devices", n)
    return names


# The count of the program's own configure_cpu_replicas() call (None: it made none); it wins
# over TFDP_CPU_REPLICAS.
_explicit: dict = {"n": None}


def _env_count():
    try:
        return cpu_replicas_from_env()
    except TfdpError:
        return None


def cpu_replicas_from_env(environ=None) -> int | None:
    """The value of TFDP_CPU_REPLICAS (validated), or None when unset/empty."""
    environ = os.environ if environ is None else environ
    raw = environ.get(CPU_REPLICAS_ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = None
    if n is None or n < 1:
        raise invalid_argument(CPU_REPLICAS_ENV, raw, fix="Set it to a positive integer, "
                               "e.g. TFDP_CPU_REPLICAS=4, or unset it.", cls=UsageError)
    return n


# What apply_cpu_replicas_env_early() saw at ``import tfdp``: the variable's count (None: unset or
# invalid) and whether TF's runtime had already started (None: TF was not imported yet).
_at_import: dict = {"n": None, "runtime_started": None}


def _runtime_started() -> bool:
    from tfdp import compat
    return compat.runtime_initialized()


def _split_cpu_now(n: int) -> bool:
    """Split the CPU into ``n`` logical devices if the runtime has not started and nothing
    configured the CPU yet; never raises (used at import time). True when split."""
    import tensorflow as tf
    try:
        cpu = tf.config.list_physical_devices("CPU")[0]
        if tf.config.get_logical_device_configuration(cpu) is not None:
            return False  # the program configured it itself: leave it (checked at strategy)
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except Exception:  # pylint: disable=broad-except  (runtime started, odd build: see strategy)
        return False
    log.debug("tfdp: host CPU split into %d logical devices (%s)", n, CPU_REPLICAS_ENV)
    return True


class _AfterTensorFlowImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: runs ``callback`` right after the ``tensorflow`` package has been
    imported (before any user code can start its runtime), then removes itself.

    It finds TensorFlow's spec with the other finders and wraps that spec's loader's
    ``exec_module`` (an instance attribute, removed again once it ran); a mere
    ``importlib.util.find_spec("tensorflow")`` probe executes nothing and keeps the hook.
    """

    def __init__(self, callback):
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tensorflow":
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        original = getattr(loader, "exec_module", None)
        if original is None:
            return spec

        def exec_module(module):
            try:
                original(module)
            finally:
                vars(loader).pop("exec_module", None)
            self.remove()
            self.callback()

        try:
            loader.exec_module = exec_module  # instance attribute shadowing the method
        except (AttributeError, TypeError):  # a loader without instance attributes: give up
            pass
        return spec

    def remove(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _run_by_tfdp_command() -> bool:
    """Whether this process is tfdp's own command line (``tfdp ...`` / ``python -m tfdp``)."""
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    if any(a == "-m" and argv[i + 1:i + 2] and argv[i + 1].split(".")[0] == "tfdp"
           for i, a in enumerate(argv)):
        return True
    return bool(sys.argv) and os.path.basename(sys.argv[0]) in ("tfdp", "tfdp.exe")


def _exit_bad_variable(error: TfdpError):
    """A bad ``TFDP_CPU_REPLICAS``: one line, exit 2 (a usage error), no traceback."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        pass
    sys.stderr.write(f"tfdp: error: {error}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def apply_cpu_replicas_env_early() -> None:
    """At ``import tfdp``: honour ``TFDP_CPU_REPLICAS`` before TensorFlow's runtime starts.

    Never imports TensorFlow itself: with TF already imported the CPU is split now (if its
    runtime has not started); otherwise right after TF gets imported. A bad value ends the
    program at once with one line and exit code 2 (``SystemExit``), before TensorFlow loads;
    under tfdp's own command line only when TensorFlow gets imported (``tfdp train`` reports it
    itself, and ``tfdp launch --cpu-replicas`` sets the workers' value).
    """
    try:
        n = cpu_replicas_from_env()
    except TfdpError as e:
        if not _run_by_tfdp_command() or "tensorflow" in sys.modules:
            _exit_bad_variable(e)
        elif not any(isinstance(f, _AfterTensorFlowImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterTensorFlowImport(lambda e=e: _exit_bad_variable(e)))
        return
    if n is None:
        return
    _at_import["n"] = n
    if "tensorflow" in sys.modules:
        try:
            started = _at_import["runtime_started"] = _runtime_started()
        except Exception:  # pylint: disable=broad-except  (TF only partly imported)
            return
        if not started:
            _split_cpu_now(n)
        return
    if not any(isinstance(f, _AfterTensorFlowImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTensorFlowImport(lambda: _split_cpu_now(n)))


def apply_cpu_replicas_env() -> int | None:
    """Apply ``TFDP_CPU_REPLICAS`` (strategy creation): the count, or None when unset.

    Raises:
      TfdpError: a bad value, or a runtime that already started with another CPU count (one
        line saying why and how to fix it).
    """
    n = cpu_replicas_from_env()
    if n is None:
        return None
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    if _explicit["n"] is not None:   # the program's own configure_cpu_replicas() call wins
        return _explicit["n"]
    if not _runtime_started():
        current = tf.config.get_logical_device_configuration(cpu)
        if current is None or len(current) != n:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
            log.debug("tfdp: host CPU split into %d logical devices (%s)", n, CPU_REPLICAS_ENV)
        return n
    have = len(tf.config.list_logical_devices("CPU"))
    if have == n:
        return n
    received = f"{CPU_REPLICAS_ENV}={n} with {have} logical CPU device(s) already in use"
    if _at_import["runtime_started"]:
        raise TfdpError(message(
            f"{CPU_REPLICAS_ENV}={n} came too late: the TensorFlow runtime started before "
            "`import tfdp`, so the CPU can no longer be split", received,
            "Import tfdp before any TensorFlow op, dataset, tensor or model is created (put "
            "`import tfdp` at the top of the script), or unset "
            f"{CPU_REPLICAS_ENV}."))
    if _at_import["n"] is None:
        raise TfdpError(message(
            f"{CPU_REPLICAS_ENV}={n} came too late: it was set after `import tfdp` and the "
            "TensorFlow runtime has started since, so the CPU can no longer be split", received,
            f"Set {CPU_REPLICAS_ENV} in the environment before the program starts (e.g. "
            f"`{CPU_REPLICAS_ENV}={n} python train.py` or tfdp launch --cpu-replicas {n}), or "
            f"call tfdp.configure_cpu_replicas({n}) before any TensorFlow code runs."))
    raise TfdpError(message(
        f"{CPU_REPLICAS_ENV}={n} does not match the program's own CPU configuration: the "
        f"TensorFlow runtime started with {have} logical CPU device(s)", received,
        f"Set {CPU_REPLICAS_ENV}={have} (tfdp launch --cpu-replicas {have}), unset it, or "
        "remove the program's own tfdp.configure_cpu_replicas() / "
        "tf.config.set_logical_device_configuration() call."))


def canonical(device: str) -> str:
    """'GPU:1', '/gpu:1', '/device:GPU:1' -> '/job:localhost/replica:0/task:0/device:GPU:1'."""
    import tensorflow as tf
    spec = tf.DeviceSpec.from_string(device if device.startswith("/") else "/device:" + device)
    if spec.device_type is None:
        raise ValueError(device)
    spec = tf.DeviceSpec(job=spec.job or "localhost", replica=spec.replica or 0,
                         task=spec.task or 0, device_type=spec.device_type.upper(),
                         device_index=spec.device_index or 0)
    return spec.to_string()


def default_devices() -> list[str]:
    """All local GPUs; else the logical CPU replicas (TFDP_CPU_REPLICAS honoured); else CPU:0."""
    import tensorflow as tf
    if tf.config.list_physical_devices("GPU"):
        return [canonical(d.name) for d in tf.config.list_logical_devices("GPU")]
    apply_cpu_replicas_env()
    return [canonical(d.name) for d in tf.config.list_logical_devices("CPU")]


def resolve_devices(devices) -> list[str]:
    """Validate a user's device list against the devices that exist here."""
    if devices is None:
        return default_devices()
    if isinstance(devices, str) or not hasattr(devices, "__iter__"):
        raise invalid_argument("devices", devices, fix="Pass a list of device names such as "
                               "['GPU:0', 'GPU:1'] or ['CPU:0', 'CPU:1'], or None for all local "
                               "devices.")
    devices = list(devices)
    if not devices:
        raise invalid_argument("devices", devices, fix="Pass at least one device, or None for "
                               "all local devices.")
    import tensorflow as tf
    env_n = apply_cpu_replicas_env()  # an explicit CPU list gets its devices from it too
    available = {canonical(d.name) for d in tf.config.list_logical_devices()
                 if d.device_type in ("CPU", "GPU")}
    result = []
    for d in devices:
        if not isinstance(d, str):
            raise invalid_argument(
                "devices", devices, what=f"Device {d!r} is not a device name",
                fix="Device names are strings such as 'GPU:0' or 'CPU:1' (not indices).")
        try:
            c = canonical(str(d))
        except ValueError:
            c = None
        if c is None or c not in available:
            raise invalid_argument(
                "devices", devices, what=f"Device {d!r} does not exist on this machine",
                valid=sorted(short_name(a) for a in available),
                fix=more_cpu_devices_hint(env_n))
        if c in result:
            raise invalid_argument("devices", devices, what=f"Device {d!r} is listed twice",
                                   fix="List each device once.")
        result.append(c)
    return result


def short_name(device: str) -> str:
    """'/job:localhost/replica:0/task:0/device:CPU:1' -> 'CPU:1'."""
    return device.rsplit("device:", 1)[-1]


def is_gpu(device: str) -> bool:
    return "GPU" in short_name(device).upper()


def more_cpu_devices_hint(env_n: int | None) -> str:
    """How to get more CPU devices: set TFDP_CPU_REPLICAS, or (when it is set) raise it."""
    if env_n is None:
        return ("Use tfdp.configure_cpu_replicas(n) (or TFDP_CPU_REPLICAS=n) for more CPU "
                "devices.")
    have = "only CPU:0" if env_n == 1 else f"CPU:0..CPU:{env_n - 1}"
    return (f"{CPU_REPLICAS_ENV}={env_n} gives {have}: list only those, or set "
            f"{CPU_REPLICAS_ENV} (tfdp launch --cpu-replicas) higher.")
