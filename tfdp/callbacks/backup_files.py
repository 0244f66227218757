"""The on-disk format of ``tfdp.callbacks.BackupAndRestore``: sidecar, state files, atomic writes.

Layout of ``backup_dir``::

    backup.json            sidecar: format, tfdp version, epoch, step_in_epoch, global_step,
                           fingerprint, state file name (replaced atomically, last)
    state-<step>.npz       variables in order: model.variables, then optimizer.variables
                           (v00000...), then the model's metric variables (m00000...)

A state file is written to a private temporary file and ``os.replace``-d into place, then the
sidecar naming it likewise, so a crash leaves the previous backup intact (leftover ``.tmp-*``
files are ignored). ``read_sidecar`` validates what it reads: another model's backup, a corrupt
sidecar or a directory that is not a tfdp backup is a clear error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import uuid

from tfdp.errors import TfdpError

SIDECAR = "backup.json"
FORMAT = "tfdp-backup"
FORMAT_VERSION = 2  # 2: metric variables (m*) and fit's input position ("input")
_STATE_RE = re.compile(r"^state-\d+\.npz$")
_TMP_PREFIX = ".tmp-"


class BackupError(TfdpError):
    """The backup directory cannot be used (unreadable, corrupt or another model's)."""


def _kind(path: str) -> str:
    """The variable's own name without its layer's (``dense_3/kernel`` -> ``kernel``)."""
    return path.rsplit("/", 1)[-1]


def _variables(model):
    optimizer = getattr(model, "optimizer", None)
    opt_vars = list(optimizer.variables) if optimizer is not None else []
    return list(model.variables), opt_vars


def fingerprint(model) -> str:
    """A short hash of the shapes, dtypes and kinds of the model's and optimizer's variables.

    Layer names are left out (Keras numbers them per process: ``dense`` vs ``dense_4``), so the
    same architecture built twice has the same fingerprint, another architecture another one.
    """
    model_vars, opt_vars = _variables(model)
    desc = {
        "model": [[_kind(v.path), list(v.shape), str(v.dtype)] for v in model_vars],
        "optimizer": [type(model.optimizer).__name__ if opt_vars else None]
        + [[list(v.shape), str(v.dtype)] for v in opt_vars],
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def _atomic_write(path: str, write) -> None:
    """``write(file)`` into a private temporary file next to ``path``, then ``os.replace``."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _not_a_directory(backup_dir: str) -> BackupError:
    """The error for a ``backup_dir`` that is a file, or lies under one."""
    path = os.path.abspath(backup_dir)
    if os.path.lexists(path):
        where = "it is a file" if os.path.exists(path) else "it is a broken symbolic link"
    else:
        blocker = os.path.dirname(path)
        while not os.path.lexists(blocker) and os.path.dirname(blocker) != blocker:
            blocker = os.path.dirname(blocker)
        where = f"{blocker!r} on its path is not a directory"
    return BackupError(f"The backup directory is not a directory ({where}). Received: "
                       f"backup_dir={backup_dir!r}. Pass the path of a directory (new or "
                       "empty, or a tfdp backup); the file is left untouched.")


def _unreadable(backup_dir: str, e: OSError) -> BackupError:
    return BackupError(
        f"The backup directory cannot be read ({type(e).__name__}: {e.strerror or e}). "
        f"Received: backup_dir={backup_dir!r}. Give this user read, write and search "
        f"permission (e.g. chmod u+rwx {backup_dir!r}), or pass another directory.")


def check_backup_dir(backup_dir: str) -> None:
    """Cheap construction-time check: ``backup_dir`` is not a file and does not lie under one."""
    if os.path.lexists(backup_dir):
        if not os.path.isdir(backup_dir):
            raise _not_a_directory(backup_dir)
        return
    parent = os.path.dirname(os.path.abspath(backup_dir))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise _not_a_directory(backup_dir)


def read_sidecar(backup_dir: str) -> dict | None:
    """The validated sidecar of ``backup_dir``, or None when there is no backup yet.

    Raises:
      BackupError: the directory holds something that is not a readable tfdp backup, is not a
        directory, or cannot be read.
    """
    path = os.path.join(backup_dir, SIDECAR)
    try:
        os.stat(path)
        has_sidecar = True
    except (FileNotFoundError, NotADirectoryError):
        has_sidecar = False
    except OSError as e:  # PermissionError: the directory cannot be searched
        raise _unreadable(backup_dir, e) from None
    if not has_sidecar:
        if not os.path.lexists(backup_dir):
            check_backup_dir(backup_dir)  # under a file: say so now, not at the first save
            return None
        if not os.path.isdir(backup_dir):
            raise _not_a_directory(backup_dir)
        try:
            names = os.listdir(backup_dir)
        except OSError as e:
            raise _unreadable(backup_dir, e) from None
        foreign = sorted(n for n in names
                         if not n.startswith(_TMP_PREFIX) and not _STATE_RE.match(n))
        if foreign:
            raise BackupError(
                f"The backup directory is not a tfdp backup. Received: backup_dir="
                f"{backup_dir!r} holding {foreign[:5]} but no {SIDECAR}. Nothing was changed "
                "in it. Pass an empty or new directory, or one written by "
                "tfdp.callbacks.BackupAndRestore (a Keras BackupAndRestore directory cannot be "
                "resumed exactly).")
        return None
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BackupError(
            f"The backup's sidecar is unreadable. Received: {path!r} ({type(e).__name__}: {e}). "
            "The backup cannot be trusted: restore the directory from a copy, or delete it to "
            "start training from scratch.") from None
    required = {"format": str, "format_version": int, "epoch": int, "step_in_epoch": int,
                "global_step": int, "fingerprint": str, "state": str}
    bad = [k for k, t in required.items()
           if not isinstance(meta, dict) or not isinstance(meta.get(k), t)]
    if isinstance(meta, dict) and meta.get("input") is not None and not (
            isinstance(meta["input"], dict)
            and all(isinstance(meta["input"].get(k), int) for k in ("iterator", "consumed"))):
        bad.append("input")
    if isinstance(meta, dict) and meta.get("format") not in (None, FORMAT):
        bad = ["format"]
    if bad or not _STATE_RE.match(meta["state"]) or meta["format_version"] > FORMAT_VERSION:
        raise BackupError(
            f"The backup's sidecar is not a valid tfdp backup. Received: {path!r} with missing "
            f"or invalid {bad or ['state/format_version']} "
            f"(content: {json.dumps(meta)[:200]}). Restore the directory from a copy, or delete "
            "it to start training from scratch.")
    return meta
