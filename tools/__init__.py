"""The ``loraledger`` command line: demo, engine, serve, replay, audit, verify, status, bench."""
