"""Local devices: logical CPU replicas and device-list validation."""

from __future__ import annotations

import logging
import os

from tfdp.errors import TfdpError, invalid_argument

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
    if current is not None and len(current) == n:
        return names
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == n:
            return [d.name for d in tf.config.list_logical_devices("CPU")]
        raise TfdpError(
            f"configure_cpu_replicas({n}) came too late: the TensorFlow runtime is already "
            f"initialised. Received: n={n} with {have} logical CPU device(s) already in use. "
            "Call tfdp.configure_cpu_replicas() (or set TFDP_CPU_REPLICAS) at the very start of "
            "the program, before any TensorFlow op, device listing or model is created.") from None
    log.info("tfdp: host CPU split into %d logical devices", n)
    return names


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
                               "e.g. TFDP_CPU_REPLICAS=4, or unset it.")
    return n


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
    n = cpu_replicas_from_env()
    if n is not None:
        configure_cpu_replicas(n)
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
                fix="Use tfdp.configure_cpu_replicas(n) (or TFDP_CPU_REPLICAS=n) for more CPU "
                    "devices.")
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
