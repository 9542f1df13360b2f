"""The bundled local reference engine (docs/engines.md) and its HTTP face.

Modules: :mod:`~engines.local.engine` (``LocalEngine``, the in-process engine, assembled from
its rooms: ``lifecycle`` (start, stop, engine-owned jobs), ``residency`` (which adapters the
model holds), ``managed_path`` (the ledger's staged protocol), ``sglang_path`` (ordinary names
as stock SGLang), ``generation``), :mod:`~engines.local.server` (SGLang-compatible + staged HTTP
endpoints; ``serve``, ``running_server``, ``python -m engines.local.server``),
:mod:`~engines.local.client` (``LocalHTTPEngine``, the staged transport over HTTP),
:mod:`~engines.local.wire` (that protocol), and the engine's parts: ``name_table`` (names,
fences), ``refs`` (per-request references), ``scheduler`` (model access, token-level
interleaving), ``model`` (torch + peft), ``prefix_cache``, ``admission`` (what adapters it
serves), ``sampling``, ``tinymodel``.

Nothing is imported here: the client side (``client``, ``wire``) must stay usable without torch.
"""
