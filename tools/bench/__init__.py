"""The benchmarks of BENCHMARKS.md: one module per figure, each runnable with ``python -m
tools.bench.<name>``, and the runner behind ``loraledger bench NAME``.

Performance is measured here and never asserted by timed tests. Each benchmark measures its
reference in the same run on the same machine, so a figure is always read as a ratio:

=====================  ==========================================================================
``runner``             ``loraledger bench NAME``: sizes (``--quick``), the machine, the rendering
``store``              the SQLite event store vs raw ``sqlite3``
``ledger``             the ledger service (SQLite or PostgreSQL) vs raw commits; recovery time
``memory``             the registry projection's memory under session churn
``publish``            publication to local engines vs copying the bytes; generation gaps
``transports``         publication by path, through an agent, by SGLang's tensor route
``ray``                binds through the Ray ledger actor vs a dict in a Ray actor
``ray_publish``        publication through Ray vs in process
``http``               the engine connection pool vs a fresh connection per request
``gateway``            the OpenAI gateway vs a bare proxy vs the engine directly
``proxy``              the bare pass-through proxy ``gateway`` measures against
``stub_engine``        the stub vLLM server ``gateway`` (and some tests) drive
``routing``            session placement policies on simulated prefix-cache engines
``fleet``              publication to hundreds of engines; serve's CPU per remote gateway
=====================  ==========================================================================

Nothing is imported here, so starting one benchmark (or the stub engine in its own process)
loads only what that one needs.
"""
