"""What many tests share, written once (tests/README.md lists it):

* :mod:`tests.support.waiting` -- :func:`~tests.support.waiting.wait_for`, the one way a test
  waits for a condition (never for a fixed time), failing with what it waited for;
* :mod:`tests.support.log` -- the one reader of a log's events (durable first when given the
  ledger), and filters by event class;
* :mod:`tests.support.ledger` -- :func:`~tests.support.ledger.publish`, a version published by
  recording what the publication driver records (no engine needed), on any ledger face;
* :mod:`tests.support.outcomes` -- :func:`~tests.support.outcomes.keep_outcome`, a call started
  in a task group whose result or error the test reads afterwards;
* :mod:`tests.support.processes` -- a ``loraledger`` command as its own OS process, ready
  once its JSON ``listening`` row says so, stopped by PID;
* :mod:`tests.support.runs` -- logs the real ledger writes on an injected clock (the fault, health
  and repeat runs), every time and number in them known in advance;
* :mod:`tests.support.fixtures` -- the fixtures every test folder can ask for (registered by
  ``tests/conftest.py``).
"""
