"""The policy of ``loraledger serve`` and ``loraledger gateway``: which roles may call each
route (docs/operations.md, "Roles", is this table in prose; a test checks every cell of it
against a running ``serve``).

One data structure, consulted by both apps (``tools/http_app.py``, and the OpenAI face through
:class:`engines.access.Access`): a route missing from it cannot be served (``KeyError`` at the
first request, and a test checks every route of the app is here).

Why the lines fall where they do:

* **rollout** generates (``/v1/``) and keeps its own sessions alive: register, renew, bind,
  release, deregister, the batched ``/sessions/commands`` and ``/leases/renew`` a
  ``RolloutWorker`` over HTTP sends. Which owner it may act for is not a role's business
  (owners are many; a role is one of four): that is the owner-bound check of the session routes.
* **gateway** (a ``loraledger gateway`` process talking to ``serve``) has rollout's rights plus
  what only a face in another process sends: ``/engines/{e}/trouble`` (a hint for the
  reconciler) and ``/provenance`` (the rows it served).
* **trainer** publishes (``/versions``, the adapter upload) and reads.
* **operator** only: suspend, resume and remove an engine, and ``/sessions/forget``. No client
  calls ``/sessions/forget``: a worker forgets the tombstones it wrote inside its
  ``/sessions/commands`` batch. Forgetting a tombstone lets a closed session id bind again, so
  the bare route is an operator's repair tool.
* **reads** (``/status``, ``/metrics``, ``/routing`` and its long poll, the live page
  ``/ui`` and its feeds) are open unless
  ``--private-reads``; then any role may read. ``/health`` is always open (probes).
"""

from __future__ import annotations

from engines.access import GATEWAY, OPERATOR, ROLES, ROLLOUT, TRAINER, Rule

_ANY = frozenset(ROLES)
_SESSIONS = frozenset({OPERATOR, ROLLOUT, GATEWAY})
_FACE = frozenset({OPERATOR, GATEWAY})
_PUBLISH = frozenset({OPERATOR, TRAINER})
_OPERATOR = frozenset({OPERATOR})

ROUTE_ROLES: dict[str, Rule] = {
    "GET /health": Rule(_ANY, open=True),
    "GET /status": Rule(_ANY, read=True),
    "GET /metrics": Rule(_ANY, read=True),
    "GET /routing": Rule(_ANY, read=True),
    "GET /ui": Rule(_ANY, read=True),
    "GET /ui/events": Rule(_ANY, read=True),
    "GET /ui/incidents": Rule(_ANY, read=True),
    "GET /ui/version/{version}": Rule(_ANY, read=True),
    "GET /ui/engine/{engine}": Rule(_ANY, read=True),
    "POST /owners": Rule(_SESSIONS),
    "POST /owners/{owner}/renew": Rule(_SESSIONS),
    "POST /owners/{owner}/deregister": Rule(_SESSIONS),
    "POST /sessions/{session}/bind": Rule(_SESSIONS),
    "POST /sessions/{session}/release": Rule(_SESSIONS),
    "POST /sessions/commands": Rule(_SESSIONS),
    "POST /leases/renew": Rule(_SESSIONS),
    "POST /sessions/forget": Rule(_OPERATOR),
    "POST /versions": Rule(_PUBLISH),
    "POST /adapters/{digest}": Rule(_PUBLISH),
    "PUT /adapters/{digest}/weights": Rule(_PUBLISH),
    "POST /engines/{engine}/suspend": Rule(_OPERATOR),
    "POST /engines/{engine}/resume": Rule(_OPERATOR),
    "POST /engines/{engine}/remove": Rule(_OPERATOR),
    "POST /engines/{engine}/trouble": Rule(_FACE),
    "POST /provenance": Rule(_FACE),
    "POST /v1/chat/completions": Rule(_SESSIONS),
    "POST /v1/completions": Rule(_SESSIONS),
    "GET /v1/models": Rule(_SESSIONS),
    "GET /v1/models/{model}": Rule(_SESSIONS),
    "POST /v1/sessions/{session}/release": Rule(_SESSIONS),
}
