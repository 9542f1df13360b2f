"""``serve`` and ``gateway`` run on uvloop where the ``fast`` extra installed it, else on
asyncio's loop (``tools.cli.common.run_server``, which both commands start through)."""

from __future__ import annotations

import asyncio
import importlib.util

from tools.cli.common import run_server, server_loop_options


def test_uvloop_is_chosen_exactly_when_it_can_be_imported() -> None:
    assert server_loop_options(lambda name: None) == {"use_uvloop": False}
    assert server_loop_options(lambda name: object() if name == "uvloop" else None) == {
        "use_uvloop": True
    }


def test_a_server_runs_on_the_loop_this_environment_offers() -> None:
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    installed = importlib.util.find_spec("uvloop") is not None
    assert run_server(loop_module).startswith("uvloop") == installed
