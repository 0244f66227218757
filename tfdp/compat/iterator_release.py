"""The one background thread that drops a distributed dataset's per-device iterators.

Destroying a multi-device iterator waits for its C++ resources (tf.data's threads): on a
``fit`` that makes one per epoch that wait would sit in the training thread, so
``CachedMultiDeviceIterator`` (``iterator_internals``) hands what it built to this thread
when it is dropped. Nothing here touches TensorFlow: it is a queue and a thread, stopped at
interpreter exit before the interpreter's objects are finalized.
"""

from __future__ import annotations

import queue
import sys
import threading

_releases = queue.SimpleQueue()
_releaser = None
_releaser_lock = threading.Lock()
_exiting = False
_left_at_exit = []  # what was still queued at exit: destroyed with the interpreter's objects
_EXIT_WAIT_S = 10.0


def _release_loop():
    while True:
        item = _releases.get()
        if _exiting:
            _left_at_exit.append(item)
            return
        del item  # the C++ destructors run here (TF releases the GIL while they wait)


def _at_exit():
    # No C++ destructor may still run in the release thread while the interpreter finalizes:
    # let it finish the one in progress (bounded), and destroy nothing more there.
    global _exiting
    _exiting = True
    _releases.put(None)
    if _releaser is not None:
        _releaser.join(_EXIT_WAIT_S)


def start_releaser() -> None:
    """Start tfdp's one background release thread, once (from ordinary code, never from a
    finalizer: this takes a lock)."""
    global _releaser
    if _releaser is not None or _exiting or sys.is_finalizing():
        # (no thread starts once the interpreter exits: Thread.start() would wait forever)
        return
    with _releaser_lock:
        if _releaser is None:
            import atexit
            thread = threading.Thread(target=_release_loop, name="tfdp-iterator-release",
                                      daemon=True)
            thread.start()
            _releaser = thread
            atexit.register(_at_exit)


def release_in_background(resources) -> None:
    """Drop ``resources`` (tensors, iterators) in the release thread (:func:`start_releaser`).

    Lock-free: it runs in ``__del__``, which the garbage collector calls at any allocation in
    any thread, also one holding a lock of this module (a trace under ``_lock`` collected an
    iterator, whose release waited on ``_lock``: the thread hung for good). ``SimpleQueue.put``
    is safe there (reentrant)."""
    if _exiting or sys.is_finalizing():
        _left_at_exit.append(resources)
        return
    if _releaser is None:  # (never started: dropped here, as TF's iterators drop theirs)
        return
    _releases.put(resources)


__all__ = ["release_in_background", "start_releaser"]
