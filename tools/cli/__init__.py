"""The ``loraledger`` command: one console script, one subcommand per job.

Every subcommand follows the same rules, so a newcomer learns them once:

* the answer goes to stdout, as rich tables for people, or ``--json`` for scripts (one JSON
  object per line when there are several);
* logs and progress bars go to stderr (quiet by default, ``-v`` shows each decision);
* a failure is one clear line on stderr and a distinct exit code (``loraledger --help`` lists
  them), never a traceback (``-vv`` adds the traceback of an unexpected internal error).

The commands only parse options, call the tool modules and render; the analysis lives in pure
folds (``projections/``) and the work in ``tools/<command>.py``. This package is the command
table, below, in the order ``loraledger --help`` lists it; each command's options are in one
module by theme:

===============  ===========================================================================
``common``       the application, ``guarded`` (those rules), ``--json``, tokens, ``main``
``demo``         ``demo``
``logs``         ``replay``, ``audit``, ``verify``: the read-only tools over a log
``remote``       ``status`` and ``fleet ...``: a running ``serve``, asked and acted on
``publish``      ``publish``: an adapter directory uploaded to a running ``serve``
``service``      ``serve`` and ``gateway``, and the option set they share
``engines``      ``engine``, ``agent``, ``check-engine``
``bench``        ``bench NAME``
===============  ===========================================================================
"""

from __future__ import annotations

from tools.cli import bench, demo, engines, logs, publish, remote, service
from tools.cli.common import DEFAULT_PORT, DEFAULT_URL, app, guarded, main

app.command()(demo.demo)
app.command()(logs.replay)
app.command()(logs.audit)
app.command()(logs.verify)
app.command()(remote.status)
app.command()(publish.publish)
app.command()(service.serve)
app.command()(service.gateway)
app.command()(engines.engine)
app.command()(engines.agent)
app.command("check-engine")(engines.check_engine)
app.add_typer(bench.bench_app, name="bench")
app.add_typer(remote.fleet_app, name="fleet")

__all__ = ["DEFAULT_PORT", "DEFAULT_URL", "app", "guarded", "main"]
