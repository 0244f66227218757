"""Import Ray Train, or say in one line how to install it."""

from __future__ import annotations

from tfdp.errors import TfdpError

INSTALL = 'pip install "tfdp[ray]"'


def ray_train():
    """The ``ray.train`` module (Ray 2.40 or newer), or a TfdpError naming the install command."""
    try:
        import ray.train
    except ImportError as e:
        raise TfdpError(f"tfdp.ray needs Ray Train, which is not installed. Received: {e}. "
                        f"Install it with {INSTALL} (or pip install \"ray[train]\").") from None
    return ray.train


def in_train_worker(what: str, elsewhere: str):
    """The ``ray.train`` module, after checking this process is a Ray Train worker.

    ``what`` names the call in the error; ``elsewhere`` says what to use outside Ray.
    """
    train = ray_train()
    try:
        train.get_context()
    except Exception as e:  # noqa: BLE001 - Ray raises RuntimeError (or its own) outside a worker
        raise TfdpError(
            f"{what} works inside a Ray Train worker only. Received: a call outside one "
            f"(ray.train.get_context() raised {type(e).__name__}). Create it inside the "
            f"function you pass to ray.train.tensorflow.TensorflowTrainer; {elsewhere}") from None
    return train
