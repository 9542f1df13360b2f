"""A fast pre-check of a campaign: pure test functions called in-process under each mutant.

mutmut runs one pytest session per mutant (its stats pick the tests); on two shared cores the
decider's 1,376 mutants take longer than a working session. The decider's and the registry's
rules are pure, so most of their tests are plain functions over ``Book``: this calls each of
them (with the ``book`` fixture built here; tests needing other fixtures, or async ones, are
left out and listed) under ``MUTANT_UNDER_TEST`` and records the first test that fails, or
``timeout`` after 30 s (``QUICK_CHECK_TIMEOUT_S``). It runs fewer tests than the campaign, so
its survivors are an upper bound on the campaign's. A mutant stopped by the alarm may leave the
process unusable for the next ones (mutmut forks per mutant): read a run of timeouts as the end
of a usable check.

Run it inside a campaign's mutants folder (``campaign.py NAME --keep DIR`` makes one; mutmut
writes the ``.meta`` files, one per mutated module, as soon as it has generated the mutants)::

    cd DIR/NAME/mutants && MUTANT_UNDER_TEST= python -m tests.mutation.quick_check \
        publisher/core/decider/fleet.py.meta out.json tests.publisher.core.test_decider \
        tests.publisher.core.test_decider_outcomes
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.publisher.core.book import Book

Case = tuple[str, Callable[..., Any], dict[str, Any]]


class Timeout(BaseException):
    """A mutant that loops: counted as killed, as mutmut counts its timeouts."""


def collect(modules: list[str]) -> list[Case]:
    """Every test function of ``modules``, one case per parametrization."""
    cases: list[Case] = []
    for modname in modules:
        for name, fn in vars(importlib.import_module(modname)).items():
            if not name.startswith("test_") or not callable(fn):
                continue
            params = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
            if not params:
                cases.append((f"{modname}::{name}", fn, {}))
                continue
            names = params[0].args[0]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
            for vals in params[0].args[1]:
                vals = getattr(vals, "values", vals)
                vals = (vals,) if len(names) == 1 else vals
                cases.append((f"{modname}::{name}", fn, dict(zip(names, vals, strict=True))))
    return cases


def run_case(fn: Callable[..., Any], kw: dict[str, Any]) -> None:
    args = dict(kw)
    sig = inspect.signature(fn).parameters
    if "book" in sig:
        args["book"] = Book().bootstrap()
    if "slow" in sig:
        args["slow"] = False
    missing = [p for p in sig if p not in args]
    if missing:
        raise RuntimeError(f"needs fixtures {missing}")
    if inspect.iscoroutinefunction(fn):
        raise RuntimeError("async")
    fn(**args)


def first_failure(cases: list[Case]) -> str | None:
    for name, fn, kw in cases:
        try:
            run_case(fn, kw)
        except Timeout:
            raise
        except BaseException:
            return name
    return None


def main(meta_path: str, out_path: str, *modules: str) -> None:
    limit_s = int(os.environ.get("QUICK_CHECK_TIMEOUT_S", "30"))
    meta = json.loads(Path(meta_path).read_text("utf-8"))
    todo = [k for k, v in meta["exit_code_by_key"].items() if v not in (1, 3)]
    os.environ["MUTANT_UNDER_TEST"] = ""
    cases = []
    for case in collect(list(modules)):
        try:
            run_case(case[1], case[2])
            cases.append(case)
        except BaseException as exc:
            print("left out", case[0], repr(exc)[:80], flush=True)
    print("cases", len(cases), "mutants", len(todo), flush=True)

    def on_alarm(*_: object) -> None:
        raise Timeout

    signal.signal(signal.SIGALRM, on_alarm)
    result: dict[str, str | None] = {}
    for mutant in todo:
        os.environ["MUTANT_UNDER_TEST"] = mutant
        signal.alarm(limit_s)
        try:
            result[mutant] = first_failure(cases)
        except Timeout:
            result[mutant] = "timeout"
        signal.alarm(0)
        print(mutant, result[mutant], flush=True)
    report = {"cases": [c[0] for c in cases], "result": result}
    Path(out_path).write_text(json.dumps(report, indent=1), "utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:])
