"""API keys as every door checks them: the token of an `Authorization: Bearer` header or an
`x-api-key` header (Anthropic's), each compared with every accepted key in constant time."""
from __future__ import annotations

import hmac
from collections.abc import Sequence


def bearer_token(header: bytes) -> bytes:
    """The token of an `Authorization: Bearer <token>` value; empty for any other scheme."""
    scheme, _, token = header.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def key_accepted(token: bytes, keys: Sequence[bytes]) -> bool:
    accepted = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        accepted |= hmac.compare_digest(token, key)
    return accepted


def authorized(authorization: bytes, x_api_key: bytes, keys: Sequence[bytes]) -> bool:
    """Whether either header carries an accepted key; `|`, not `or`: both are always compared,
    whichever carries the key."""
    return key_accepted(bearer_token(authorization), keys) | key_accepted(x_api_key.strip(), keys)
