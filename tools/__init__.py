"""The ``loraledger`` command line: demo, serve, replay, audit, verify, status, bench."""
