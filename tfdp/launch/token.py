"""The rendezvous token: a secret every node of a multi-node ``tfdp launch`` job is given
(``--rdzv-token`` or ``TFDP_RDZV_TOKEN``), so that only they can join the job.

The secret never crosses the network. Node 0 greets every connection with a random challenge;
a joining node answers with an HMAC-SHA256 of the challenge and its join message under the
token, and node 0 answers the cluster with an HMAC of the joining node's own challenge and the
reply, so each side proves it holds the token to the other (a recorded exchange replays
nothing: the challenges are fresh). The connections are not encrypted: what crosses them (host
names, ports, how workers ended) is not secret, and TensorFlow's gRPC servers between the
workers stay unauthenticated: keep the nodes on a private network.

Importing this module never imports TensorFlow.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets

from tfdp import errors
from tfdp.errors import UsageError

ENV = "TFDP_RDZV_TOKEN"
MIN_LENGTH = 16
MAKE_ONE = "openssl rand -hex 32 (or python -c 'import secrets; print(secrets.token_hex(32))')"


def resolve(token: str | None, environ, cli: bool = False) -> str | None:
    """The job's token: ``token`` (``--rdzv-token``), else ``$TFDP_RDZV_TOKEN``, else None.
    A token shorter than 16 characters, or with spaces, is a one-line error."""
    name = "--rdzv-token" if cli else "rdzv_token"
    source = name
    if token is None:
        token, source = environ.get(ENV) or None, ENV
    if token is None:
        return None
    if not isinstance(token, str) or len(token) < MIN_LENGTH or any(c.isspace() for c in token):
        shown = (f"{len(token)} characters" if isinstance(token, str) else repr(token))
        raise errors.invalid_argument(
            source, shown, cls=UsageError,
            what=f"The rendezvous token ({source}) must be at least {MIN_LENGTH} characters "
                 "without spaces",
            fix=f"Make one per job, e.g. export {ENV}=$({MAKE_ONE.split(' (')[0]}), and give "
                "every node the same.")
    return token


def challenge() -> str:
    """A fresh random challenge (hex)."""
    return secrets.token_hex(16)


def _canonical(message: dict) -> bytes:
    return json.dumps({k: v for k, v in message.items() if k != "proof"}, sort_keys=True,
                      separators=(",", ":")).encode()


def proof(token: str, purpose: str, nonce: str, message: dict) -> str:
    """HMAC-SHA256 under ``token`` of ``purpose``, the other side's ``nonce`` and ``message``
    (its ``proof`` field left out)."""
    data = purpose.encode() + b"\0" + nonce.encode() + b"\0" + _canonical(message)
    return hmac.new(token.encode(), data, hashlib.sha256).hexdigest()


def verify(token: str, purpose: str, nonce: str, message: dict) -> bool:
    """Whether ``message["proof"]`` proves its sender holds ``token`` (constant time)."""
    got = message.get("proof")
    if not isinstance(got, str) or not isinstance(nonce, str):
        return False
    return hmac.compare_digest(got, proof(token, purpose, nonce, message))


def environ_without(environ) -> dict:
    """``environ`` without the token (the workers do not need it)."""
    env = dict(os.environ if environ is None else environ)
    env.pop(ENV, None)
    return env
