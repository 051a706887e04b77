"""Cache salts with a private scope: hashed whole, published in part (pure Python).

A request's `cache_salt` goes into its first block's hash, so requests with different
salts never share blocks. A scoped salt adds a scope the request itself does not carry
(the server's tenant, known from the API key):

    scoped_cache_salt("alpha", "s1")   hashed whole: alpha's "s1" is not beta's "s1"
    published_salt(...) == "s1"        what KV events say the first block was salted with

A router that reads KV events (llm-d's precise prefix scorer) hashes a request from its
body, where only the client's own `cache_salt` is; publishing that part keeps its keys
equal to the events' while the engine still keeps scopes apart.
"""

from __future__ import annotations

import json

# Starts every scoped salt. A client cannot send it as its own salt on a server with
# scopes: there every client salt is wrapped in one.
_SCOPED = "\x00scoped\x00"


def scoped_cache_salt(scope: str, salt: str | None) -> str:
    """The salt of a request from `scope` that carries the client's own `salt` (or none)."""
    return _SCOPED + json.dumps([scope, salt])


def published_salt(salt: str) -> str | None:
    """The part of `salt` a router can compute from the request: a scoped salt's client
    part (None when the client sent none), any other salt whole."""
    if not salt.startswith(_SCOPED):
        return salt
    try:
        _scope, public = json.loads(salt[len(_SCOPED) :])
    except (ValueError, TypeError):  # not one of ours, only made to look like one
        return salt
    return public if isinstance(public, str) else None
