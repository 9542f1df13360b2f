"""Mutation campaigns: does the suite fail when a core rule is changed by one token?

Each campaign runs mutmut 3 over one module (or two) against the fast tests that claim to
check it, in a throwaway copy of the tree (mutmut writes ``mutants/`` next to the sources it
mutates; a copy keeps the work tree clean and lets campaigns use different test sets). A mutant
that no test kills is a *survivor*. A survivor is accepted only when ``survivors.toml`` lists it
with a reason:

- ``equivalent``: no test can kill it, because the mutated program behaves the same (the reason
  says why);
- ``open``: a real gap not yet closed by a test (kept so that the gate still catches *new*
  survivors; RELIABILITY.md lists them as debt).

Survivors are keyed by what changed, not by mutmut's mutant number (which shifts when the code
above it changes): ``function``, the source ``line`` the change is on, and ``change`` (the
smallest differing expression, old -> new, as ``ast.unparse`` writes it).

A mutant that only rewrites the wording of an exception's message (mutmut turns ``"text"`` into
``"XXtextXX"`` or ``"TEXT"``), or of the field name a validator puts in its message
(``_time(value, "now")``), is counted apart as ``message``: the promise is a stable machine
code and a message that names the problem, which such a mutant keeps; tests assert codes.

Run (one command; ``--slow`` runs the gated campaigns through ``test_mutation.py``)::

    python -m tests.mutation.campaign decider registry      # or: all
    pytest --slow tests/mutation

CPU: the decider campaign generates ~2,200 mutants and takes ~28 min on two idle cores; the
campaigns over the grown modules (tensor_wire, renewals, verify, forensics, guard) take from
seconds (renewals) to ~5 min (tensor_wire, whose tests load torch) each.
"""

from __future__ import annotations

import argparse
import ast
import copy
import fnmatch
import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.paths import REPO

ROOT = REPO
SURVIVORS_FILE = Path(__file__).with_name("survivors.toml")
PACKAGES = ("evlog", "projections", "publisher", "engines", "tools")
# The decider's validators whose last argument is only a word of their error message (the others
# also put it in the error's details, as `field`: a machine-read value, not counted as wording).
LABEL_HELPERS = frozenset({"_time"})
# Calls that build an error from a message, besides ``...Error(...)`` classes: the registry's
# ``impossible(subject, state, event, reason)``; the OpenAI face's ``BadRequest(message)`` (400
# INVALID_INPUT), ``error_response(code, message)`` and ``send_error(send, code, message)``.
ERROR_BUILDERS = frozenset({"impossible", "BadRequest", "error_response", "send_error"})
# A mutant that only changes the arguments of a log call (the event name, a field) is counted
# apart as ``log``: log lines are diagnostics for a person, not a promise the tests hold.
LOG_LEVELS = frozenset({"debug", "info", "warning", "error", "exception", "critical"})


@dataclass(frozen=True)
class Campaign:
    """Which files to mutate, against which tests, and whether a survivor fails the gate."""

    name: str
    mutate: tuple[str, ...]
    tests: tuple[str, ...]
    gated: bool
    # more pytest options for this campaign's runs (after the common ones below)
    pytest_args: tuple[str, ...] = ()
    # mutmut's CPU limit per mutant, (its tests' time + this) x 8 CPU seconds: raised where each
    # mutant's session pays a fixed cost its tests' times do not show (a server to start)
    timeout_constant: float = 1.0


CAMPAIGNS: dict[str, Campaign] = {
    c.name: c
    for c in (
        Campaign(
            "decider",
            # Every module of the package but its face, which defines nothing: keep it so, as
            # `_describe` names a mutant's file after its module (`<package>.py`, not found).
            (
                "publisher/core/decider/decide.py",
                "publisher/core/decider/decision.py",
                "publisher/core/decider/checks.py",
                "publisher/core/decider/fleet.py",
                "publisher/core/decider/absence_proofs.py",
                "publisher/core/decider/allocation.py",
                "publisher/core/decider/publication.py",
                "publisher/core/decider/owners.py",
                "publisher/core/decider/sessions.py",
                "publisher/core/decider/reclaim.py",
            ),
            (
                "tests/publisher/core/test_decider.py",
                "tests/publisher/core/test_decider_outcomes.py",
                # suspension, lost adapters, owed drops
                "tests/publisher/core/test_decider_health.py",
                "tests/publisher/core/test_ledger_model.py",
                "tests/publisher/core/test_owner_incarnations.py",  # incarnations, deregistration
                "tests/publisher/core/test_check_order.py",  # one check order, cell by cell
                "tests/projections",
            ),
            gated=True,
        ),
        Campaign(
            "registry",
            ("projections/registry.py", "projections/transitions.py"),
            (
                "tests/publisher/core/test_decider.py",
                "tests/publisher/core/test_decider_outcomes.py",
                # suspension, lost adapters, owed drops
                "tests/publisher/core/test_decider_health.py",
                "tests/publisher/core/test_ledger_model.py",
                "tests/publisher/core/test_owner_incarnations.py",  # incarnations, deregistration
                "tests/publisher/core/test_check_order.py",  # one check order, cell by cell
                "tests/projections",
            ),
            gated=True,
        ),
        Campaign(
            "stores",
            (
                "evlog/sqlite.py",  # the SQL of the write path, the file checks, connections
                "evlog/memory.py",
                "evlog/group_commit.py",
                # the durable stores' one write path (fast and slow path, snapshot checks,
                # failures), verified reads, follow, verify, close
                "evlog/chained_store.py",
                "evlog/append_plan.py",  # plan_appends: positions, idempotency, expected_seq
                "evlog/record.py",  # open_row: what a read verifies, in which order
            ),
            (
                # Both contracts bound to memory and SQLite. PostgreSQL's binding of the same
                # contracts is left out: it would start a server for every mutant's session.
                "tests/evlog/test_memory_store.py",
                "tests/evlog/test_sqlite_store.py",
                "tests/evlog/test_sqlite_file_checks.py",  # what a file must be to be opened
                "tests/evlog/test_sqlite_connections.py",  # settings; cleanup when a step fails
                "tests/evlog/test_upcasters.py",  # decode_event under open_row
                "tests/evlog/test_record.py",  # event ids, pending_many, a row's checks
                "tests/evlog/test_append_plan.py",  # a group's calls resolved together
            ),
            gated=True,
        ),
        Campaign(
            "postgres",
            # the PostgreSQL store's SQL, sessions (synchronous_commit forced), layout checks
            ("evlog/postgres.py",),
            (
                # The store runs in process against one throwaway server per mutant's session
                # (tools/pg_server.py). test_postgres_durable_on_any_server.py starts a server
                # of its own per test (its stop can pass the 60 s limit under load, a false
                # kill): test_postgres_connections.py states its synchronous_commit rule on a
                # database of the shared server configured off.
                "tests/evlog/test_postgres_store.py",  # both store contracts
                # URLs, read-only, a dying or silent server, every session's settings, bounds
                "tests/evlog/test_postgres_connections.py",
            ),
            gated=True,
            # The session's server is stopped and its data directory (a database per test)
            # removed in the last test's teardown: over 60 s on loaded cores, a false kill.
            # The 60 s limit holds the tests themselves; mutmut's wall timeout the rest.
            pytest_args=("-o", "timeout_func_only=true"),
            # a mutant of an error path maps to a test or two (a CPU limit of ~10 s), but its
            # session starts the server first: mutmut's limit stopped it (a false kill)
            timeout_constant=15.0,
        ),
        Campaign(
            "gateway",
            # the dispatch executor and what it reads an engine's error and the counts with
            (
                "publisher/gateway/dispatch.py",
                "publisher/gateway/failures.py",
                "publisher/gateway/inflight.py",
            ),
            (
                "tests/publisher/gateway/test_gateway.py",
                "tests/publisher/gateway/test_gateway_dispatch.py",
                "tests/publisher/core/test_errors.py",  # each dispatch code's family
                # in-flight evidence, read by reclaim
                "tests/publisher/drivers/test_reclaim_inflight.py",
                "tests/publisher/gateway/test_staleness.py",  # check_staleness, staleness
                # tried elsewhere, engine trouble
                "tests/publisher/gateway/test_gateway_elsewhere.py",
            ),
            gated=True,
        ),
        Campaign(
            "openai",
            # the OpenAI-compatible face: admission (roles, body cap, the session, the pin), the
            # relay's client-held sessions, the streaming relay, OpenAI's error shape
            (
                "publisher/openai/admission.py",
                "publisher/openai/relay.py",
                "publisher/openai/face.py",
            ),
            # In process only: the apps over httpx's ASGI transport or uvicorn on loopback, in
            # this process, so they import the mutated modules.
            (
                "tests/publisher/openai",
                "tests/publisher/gateway/test_dispatch_faces.py",  # one executor, both faces
                "tests/tools/test_openai_limits.py",  # the body cap, the upstream timeout
            ),
            gated=False,
        ),
        Campaign(
            "reclaim",
            ("publisher/drivers/reclaim.py",),
            (
                "tests/publisher/drivers/test_reclaim.py",
                "tests/publisher/drivers/test_reclaim_inflight.py",
                "tests/publisher/drivers/test_reclaim_answers.py",
                "tests/publisher/drivers/test_reclaim_driver.py",  # the loop, timeouts, artifacts
            ),
            gated=True,
        ),
        Campaign(
            "reconciler",
            # the health loop: probes, reports of trouble, repairs and restores, hold out and let
            # in, suspend and resume, `settled`, `wakes`
            ("publisher/drivers/reconciler.py",),
            # In process, against the recording engine double. The fault tests with real
            # processes (tests/fault) import the unmutated module: left to the suite.
            (
                "tests/publisher/drivers/test_reconciler.py",
                "tests/publisher/drivers/test_reconciler_health.py",
                "tests/publisher/drivers/test_reconciler_reachability.py",
                # lost replies, restarts mid-publication, fatal candidates the reconciler unloads
                "tests/publisher/drivers/test_publication_faults.py",
            ),
            gated=True,
        ),
        Campaign(
            "tensor_wire",
            # the untrusted payload's decoding: an allowlist unpickler, storages weights-only
            ("engines/tensor_wire.py",),
            (
                "tests/engines/test_tensor_payloads_never_run_code.py",
                "tests/engines/test_tensor_wire_refusals.py",  # each refusal, empty tensors
            ),
            gated=True,
        ),
        Campaign(
            "renewals",
            ("publisher/remote/renewals.py",),
            ("tests/publisher/remote/test_renewals.py",),
            gated=True,
        ),
        Campaign(
            "remote_ledger",
            # the remote ledger client a gateway or face reaches serve with: coalesced round
            # trips, forwarded renewals and confirmations, trouble reports, provenance resends,
            # the routing copy; and the routing tables serve sends it
            ("publisher/remote/client.py", "publisher/remote/routing.py"),
            # In process: serve's app through httpx's ASGI transport, so the mutated client is
            # what runs, a fraction of a second a test. The loopback tests of the same client
            # (test_http_ledger.py, test_lease_confirmation.py, test_provenance_to_the_ledger.py,
            # test_inflight_reaches_the_ledger_at_admission.py: uvicorn per test, whose
            # shutdown waits 2 s for the client's long poll) are left to the suite:
            # test_remote_client.py states each of their client rules on the client itself.
            (
                "tests/publisher/remote/test_remote_client.py",
                "tests/publisher/remote/test_routing.py",
            ),
            gated=True,
        ),
        Campaign(
            "guard",
            # what every HTTP server checks before a handler: token, body cap, strict JSON
            ("engines/guard.py",),
            # In process only: a server started as a subprocess imports the mutated module
            # outside mutmut's folder and cannot start (test_token_files.py's fleet). The
            # servers' trust, limit and drain tests (test_server_trust.py,
            # test_serve_limits.py, test_guard_drain.py: 16 MB uploads, a minute per mutant
            # under load) are left to the suite: test_guard_rules.py states each of their
            # guard rules on the guard itself, in seconds.
            (
                "tests/engines/test_guard_parsing.py",  # strict JSON's bounds, the messages
                # token files, each refusal, the checks before a handler, the connection limits
                "tests/engines/test_guard_rules.py",
            ),
            gated=True,
        ),
        Campaign(
            "agent",
            # the engine-side agent: stages weights on disk, loads and unloads on its engine,
            # relays drains as 503, answers its staged protocol over HTTP
            ("engines/agent.py",),
            # In process only (the agent's app on loopback in this process, a real local engine
            # behind it): the boundary tests that start `loraledger agent` processes import the
            # unmutated module and kill nothing (test_agent_boundary.py's first two,
            # test_agent_command.py, test_agent_fleet.py, test_served_content.py).
            (
                "tests/engines/test_agent_rules.py",  # each rule on the agent itself
                "tests/engines/test_agent_relays_drain.py",
                "tests/engines/test_agent_stages_on_disk.py",
                # the engine contract through the agent, over HTTP and hosted in process
                "tests/engines/test_contract_local.py::TestAgentAndEngine",
                "tests/engines/test_contract_local.py::TestHostedAgent",
                # staging per attempt, capped, expiring; managed names after a restart
                "tests/security/test_agent_boundary.py::test_a_restarted_agent_still_knows_its_managed_names",
                "tests/security/test_agent_boundary.py::test_a_stray_bucket_or_prepare_does_not_wipe_a_publications_staging",
                "tests/security/test_agent_boundary.py::test_staging_is_capped_in_bytes",
                "tests/security/test_agent_boundary.py::test_staging_prepared_and_never_loaded_expires_when_idle",
            ),
            gated=True,
        ),
        Campaign(
            "logfile",
            # how the read-only tools open a log: refusals from the raw bytes, the three ways
            # to read without writing, a read that raced a writer
            ("tools/logfile.py",),
            (
                "tests/tools/test_logfile.py",
                "tests/tools/test_tools_read_the_wal.py",  # a crashed writer's -wal is read
            ),
            gated=True,
        ),
        Campaign(
            "audit_tool",
            # `loraledger audit`: a session's generations joined with its bindings, mismatches
            ("tools/audit.py",),
            (
                "tests/tools/test_audit.py",  # the command on the fault run's log
                "tests/tools/test_audit_join.py",  # the join, pure: lives, order, each mismatch
            ),
            gated=True,
        ),
        Campaign(
            "verify",
            ("tools/verify.py",),
            # the CLI on damaged files; the verdict's every field, its progress, a changed file
            ("tests/tools/test_verify.py", "tests/tools/test_verify_verdict.py"),
            gated=True,
        ),
        Campaign(
            "forensics",
            # the folds the forensic commands read: why a version stalls, a session's audit
            ("projections/stalls.py", "projections/audit.py"),
            (
                "tests/projections/test_history.py",
                "tests/projections/test_audit.py",
                "tests/projections/test_audit_fold.py",  # every life, fact for fact
                "tests/projections/test_stall_explain.py",  # every stall, field for field
                "tests/tools/test_replay.py",  # `replay --why`: each obstacle and what cleared it
            ),
            gated=True,
        ),
        Campaign(
            "incidents",
            # the incident fold the replay and verify tools read: outages, stalls, restores
            ("projections/incidents.py",),
            (
                "tests/projections/test_incidents.py",
                "tests/projections/test_history.py",
                "tests/tools/test_replay.py",  # `replay --incidents` in process
                "tests/tools/test_verify.py",  # verify's engine-health incidents
                "tests/tools/test_verify_verdict.py",
                "tests/tools/test_fault_logs.py",  # the fault run's injected faults, each named
            ),
            gated=True,
            # Each mutant's session first writes the recorded runs through the real ledger
            # (session fixtures), CPU its tests' times do not show: with the default, mutmut's
            # limit stopped mutants no test killed (a false kill).
            timeout_constant=15.0,
        ),
        Campaign(
            "sessions",
            # a session's bind, pin and release; its owner's lease, renewals, idle release
            (
                "publisher/sessions/binder.py",
                "publisher/sessions/worker.py",
                "publisher/sessions/port.py",
            ),
            (
                "tests/publisher/sessions/test_sessions.py",
                "tests/publisher/core/test_idle_release.py",
                "tests/publisher/openai/test_relay_sessions.py",  # client-held sessions
                "tests/publisher/drivers/test_reclaim_inflight.py",  # counts with renewals
            ),
            gated=True,
        ),
        Campaign(
            "ray_face",
            # the Ray face's engine book: where a restarted ledger actor finds the engines
            # added or replaced at runtime, and the fleet it opens with
            ("publisher/ray/engine_book.py",),
            # In process, over doubles of Ray's key-value table and named actors: a test on a
            # Ray instance (test_engine_book.py) would start one per mutant.
            ("tests/publisher/ray/test_engine_book_rules.py",),
            gated=True,
        ),
        Campaign(
            "ray_ledger",
            # the Ray face's ledger actor: what it adds to the one ledger service (the fleet's
            # handles on replies, fencing, lease expiry on its loop, runtime fleet changes kept
            # in the engine book) and what it forwards to it (arguments in order, defaults)
            ("publisher/ray/ledger_actor.py",),
            # In process: the actor's class and its hosted service without Ray, on a real
            # SQLite log and a real plane over local engines. The tests on a Ray instance
            # (test_ledger_actor.py, test_fleet_runtime.py) would start one per mutant, and
            # their actors import the unmutated module.
            ("tests/publisher/ray/test_ledger_actor_rules.py",),
            gated=True,
        ),
    )
}


@dataclass(frozen=True)
class Survivor:
    """One surviving mutant, described by what it changed."""

    mutant: str
    file: str
    function: str
    line: str
    change: str
    message_only: bool
    log_only: bool = False

    def key(self) -> tuple[str, str, str, str]:
        return (self.file, self.function, self.line, self.change)


@dataclass
class Report:
    campaign: str
    generated: int = 0
    killed: int = 0
    other: dict[str, int] = field(default_factory=dict)
    survivors: list[Survivor] = field(default_factory=list)
    accepted: dict[tuple[str, str, str, str], dict[str, str]] = field(default_factory=dict)
    # Set when every mutant of the campaign was judged (not a --changed-since run): only then
    # can an accepted entry that no survivor matches be called stale.
    mutated: tuple[str, ...] = ()

    def stale(self) -> list[tuple[str, str, str, str]]:
        """Entries of survivors.toml for this campaign's files that no survivor matches any
        more (the code moved or a test now kills them): the file must say what is true."""
        found = {s.key() for s in self.survivors}
        return [k for k in self.accepted if k[0] in self.mutated and k not in found]

    def classify(self) -> dict[str, list[Survivor]]:
        """Split survivors into message / equivalent / open / unexplained."""
        out: dict[str, list[Survivor]] = {
            "message": [],
            "log": [],
            "equivalent": [],
            "open": [],
            "new": [],
        }
        for s in self.survivors:
            if s.message_only:
                out["message"].append(s)
            elif s.log_only:
                out["log"].append(s)
            elif s.key() in self.accepted:
                out[self.accepted[s.key()]["kind"]].append(s)
            else:
                out["new"].append(s)
        return out


def load_accepted() -> dict[tuple[str, str, str, str], dict[str, str]]:
    """The documented survivors: each with a kind (equivalent/open) and a one-line reason."""
    data = tomllib.loads(SURVIVORS_FILE.read_text("utf-8"))
    accepted = {}
    for entry in data.get("survivor", []):
        if entry["kind"] not in ("equivalent", "open") or not entry.get("reason"):
            raise ValueError(f"survivors.toml: {entry} needs kind equivalent|open and a reason")
        accepted[(entry["file"], entry["function"], entry["line"], entry["change"])] = entry
    return accepted


_IGNORE = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")


def _copy_tree(dest: Path, campaign: Campaign) -> None:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=_IGNORE)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=_IGNORE)
    # test_check_order.py reads the state machine's table from docs/state-machine.md
    shutil.copytree(ROOT / "docs", dest / "docs", ignore=_IGNORE)
    # mutmut mutates only under its source paths and copies the rest as is: a campaign over
    # engines/ or tools/ adds that package to the sources (only_mutate still picks the files).
    sources = sorted(
        {"evlog", "projections", "publisher"} | {p.split("/")[0] for p in campaign.mutate}
    )
    copied = [pkg for pkg in ("engines", "tools") if pkg not in sources] + ["docs"]
    config = (ROOT / "pyproject.toml").read_text("utf-8")
    config += "\n[tool.mutmut]\n" + "\n".join(
        [
            f"source_paths = {json.dumps(sources)}",
            f"only_mutate = {json.dumps(list(campaign.mutate))}",
            f"also_copy = {json.dumps(copied)}",
            # --timeout: a mutant that hangs a test (a stranded group-commit leader, a lost
            # wake-up) fails it after 60 s instead of costing mutmut's wall timeout, which is a
            # multiple of the time of every test that covers the function (minutes). The
            # slowest test takes 5 s on two idle cores; on cores overloaded by other jobs a
            # healthy test can pass 30 s, and its "kill" then shows as a stale entry.
            "pytest_add_cli_args = "
            + json.dumps(
                [
                    *("-p", "no:cacheprovider", "-m", "not vllm and not slow", "-q"),
                    *("--timeout", "60", *campaign.pytest_args),
                ]
            ),
            f"pytest_add_cli_args_test_selection = {json.dumps(list(campaign.tests))}",
            "use_git_change_detection = false",
            # mutmut's own wall timeout, (its tests' time + 1 s) x this, for what --timeout
            # cannot interrupt. Timeouts count as killed either way.
            "timeout_multiplier = 4.0",
            f"timeout_constant = {campaign.timeout_constant}",
        ]
    )
    (dest / "pyproject.toml").write_text(config + "\n", "utf-8")


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {
        n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _first_difference(a: ast.AST, b: ast.AST) -> tuple[ast.AST, ast.AST, list[ast.AST]]:
    """The smallest pair of differing expressions, and the chain of original ancestors above.

    An operator (``<=`` -> ``<``, ``and`` -> ``or``) has no text of its own: the pair returned
    is then the expressions that hold it.
    """
    chain: list[tuple[ast.AST, ast.AST]] = []
    while True:
        if type(a) is not type(b):
            break
        diffs = []
        lengths_differ = False
        for name, va in ast.iter_fields(a):
            vb = getattr(b, name, None)
            if isinstance(va, list) and isinstance(vb, list):
                if len(va) != len(vb):
                    lengths_differ = True
                    break
                diffs += [(x, y) for x, y in zip(va, vb, strict=True) if _dump(x) != _dump(y)]
            elif _dump(va) != _dump(vb):
                diffs.append((va, vb))
        nodes = [(x, y) for x, y in diffs if isinstance(x, ast.AST) and isinstance(y, ast.AST)]
        if lengths_differ or len(diffs) != 1 or len(nodes) != 1:
            break
        chain.append((a, b))
        a, b = nodes[0]
    while chain and not (isinstance(a, ast.expr | ast.stmt) and ast.unparse(a)):
        a, b = chain.pop()
    return a, b, [x for x, _ in chain]


def _dump(x: object) -> str:
    return ast.dump(x) if isinstance(x, ast.AST) else repr(x)


def _is_message(old: ast.AST, new: ast.AST, chain: list[ast.AST]) -> bool:
    """A string constant reworded inside an ``...Error(...)`` call's message, a value formatted
    into such a message changed, or a label of a message-only validator
    (:data:`LABEL_HELPERS`) changed: message wording only."""
    calls = [_call_name(n) for n in chain if isinstance(n, ast.Call)]
    in_fstring = [i for i, n in enumerate(chain) if isinstance(n, ast.JoinedStr)]
    if in_fstring and (
        any(_is_error(_call_name(n)) for n in chain[: in_fstring[0]] if isinstance(n, ast.Call))
        or _is_refusal_message(chain[: in_fstring[0] + 1])
    ):
        return True  # a value formatted into an error's message
    if not (isinstance(old, ast.Constant) and isinstance(old.value, str)):
        return False
    if calls and calls[-1] in LABEL_HELPERS:
        return True
    if not (isinstance(new, ast.Constant) and isinstance(new.value, str)):
        return False
    if old.value.lower() != new.value.lower() and f"XX{old.value}XX" != new.value:
        return False
    return any(_is_error(name) for name in calls) or _is_refusal_message([*chain, old])


def _is_refusal_message(nodes: list[ast.AST]) -> bool:
    """Whether ``nodes`` (ancestors, outermost first) pass through the message of a refusal
    returned as a ``(code, message)`` pair, ``(OpenAICode.MODEL_NOT_FOUND, f"...")``: a pair
    whose first element is a constant of a ``...Code`` class, its second the next node."""
    return any(
        isinstance(pair, ast.Tuple)
        and len(pair.elts) == 2
        and isinstance(pair.elts[0], ast.Attribute)
        and isinstance(pair.elts[0].value, ast.Name)
        and pair.elts[0].value.id.endswith("Code")
        and below is pair.elts[1]
        for pair, below in itertools.pairwise(nodes)
    )


def _is_log_call(node: ast.AST) -> bool:
    """A call of the module's structlog logger (``log.info(...)``, ``log.warning(...)``)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "log"
        and node.func.attr in LOG_LEVELS
    )


def _is_error(name: str) -> bool:
    return name.endswith("Error") or name in ERROR_BUILDERS


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


@functools.cache
def _parsed(path: Path) -> tuple[str, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    text = path.read_text("utf-8")
    return text, _functions(ast.parse(text))


def _describe(workdir: Path, mutant: str) -> Survivor:
    """Survivor description from the mutant and the original function in mutants/."""
    # mutant = "<module>.x_<function>__mutmut_N" or "<module>.xǁClassǁmethod__mutmut_N"
    head = mutant.rsplit("__mutmut_", 1)[0]
    module_path, _, local = head.rpartition(".x")
    path = module_path.replace(".", "/") + ".py"
    text, funcs = _parsed(workdir / "mutants" / path)
    orig_name = "x" + local + "__mutmut_orig"
    mut_name = mutant.rpartition(".")[2]
    mutated = copy.copy(funcs[mut_name])
    mutated.name = orig_name  # the names differ by construction; compare the rest
    old, new, chain = _first_difference(funcs[orig_name], mutated)
    lines = text.splitlines()
    located = [n for n in (*chain, old) if hasattr(n, "lineno")]  # a comprehension has none
    line = lines[located[-1].lineno - 1].strip() if located else ""
    function = local.lstrip("_").replace("ǁ", ".").strip(".") if "ǁ" in local else local[1:]
    return Survivor(
        mutant=mutant,
        file=path,
        function=function,
        line=line,
        change=f"{_unparse(old)} -> {_unparse(new)}",
        message_only=_is_message(old, new, chain),
        log_only=any(_is_log_call(n) for n in (*chain, old)),
    )


def _unparse(node: ast.AST) -> str:
    text = ast.unparse(node) if isinstance(node, ast.AST) else repr(node)
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:157] + "..."


def changed_functions(campaign: Campaign, since: str) -> list[str]:
    """Mutant-name patterns of the functions of ``campaign`` whose code differs from revision
    ``since`` (new ones included): a rerun after a change checks only what changed (mutmut
    names mutants ``<module>.x_<function>__mutmut_N`` or ``<module>.xǁClassǁmethod__mutmut_N``)."""

    def functions(text: str) -> dict[str, str]:
        found = {}
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found["_" + node.name] = ast.dump(node)
            elif isinstance(node, ast.ClassDef):
                for m in node.body:
                    if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef):
                        found[f"ǁ{node.name}ǁ{m.name}"] = ast.dump(m)
        return found

    patterns = []
    for path in campaign.mutate:
        old = subprocess.run(
            ["git", "show", f"{since}:{path}"], cwd=ROOT, capture_output=True, text=True
        )
        before = functions(old.stdout) if old.returncode == 0 else {}
        module = path.removesuffix(".py").replace("/", ".")
        for name, dump in functions((ROOT / path).read_text("utf-8")).items():
            if before.get(name) != dump:
                patterns.append(f"{module}.x{name}__mutmut_*")
    return patterns


def run_campaign(
    campaign: Campaign, *, workdir: Path, max_children: int, only: list[str] | None = None
) -> Report:
    """Copy the tree, run mutmut (on the mutants matching ``only``, or all), and read back
    every mutant's verdict."""
    _copy_tree(workdir, campaign)
    if only == []:
        return read_report(campaign, workdir, only)  # nothing changed: nothing to run
    _mutmut(workdir, only or [], max_children=max_children)
    return read_report(campaign, workdir, only)


def recheck_survivors(campaign: Campaign, *, workdir: Path, max_children: int) -> Report:
    """Run the survivors of a kept campaign (``--keep``) again against the tests as they are now,
    with the mutants that run did not reach (it may have been stopped).

    For the loop of killing survivors: a killed mutant stays killed when tests are only added,
    so only the survivors need a new verdict (minutes instead of the whole campaign). Refused
    when a mutated source changed since that run (its mutants are stale: run it in full). The
    gate always runs the whole campaign."""
    for path in campaign.mutate:
        if (workdir / path).read_bytes() != (ROOT / path).read_bytes():
            raise SystemExit(f"{path} changed since the run in {workdir}: run the campaign again")
    kept = tomllib.loads((workdir / "pyproject.toml").read_text("utf-8"))["tool"]["mutmut"]
    if kept["pytest_add_cli_args_test_selection"] != list(campaign.tests):
        # mutmut would reset every verdict anyway when its test selection changes
        raise SystemExit(f"the {campaign.name} campaign's test files changed: run it again")
    shutil.rmtree(workdir / "tests")
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=_IGNORE)
    # mutmut maps each function to the tests that call it once, and then only for new tests:
    # a test changed since would keep its old map, so the map is rebuilt (one traced run).
    (workdir / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    todo = [
        mutant
        for path in campaign.mutate
        for mutant, code in _verdicts(workdir, path).items()
        if code in (0, 33, None)  # survived, no test reached it, or not checked (a run stopped)
    ]
    if todo:
        _mutmut(workdir, todo, max_children=max_children)
    return read_report(campaign, workdir)


def _mutmut(workdir: Path, mutants: list[str], *, max_children: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with (workdir / "mutmut.log").open("a") as log:
        subprocess.run(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *mutants],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )


def read_report(campaign: Campaign, workdir: Path, only: list[str] | None = None) -> Report:
    """Every mutant's verdict (of those matching ``only``, when given), as mutmut recorded it
    in ``mutants/<file>.meta``."""
    from mutmut.stats import status_by_exit_code  # the dev extra; only a run needs it

    report = Report(
        campaign.name, accepted=load_accepted(), mutated=campaign.mutate if only is None else ()
    )
    for path in campaign.mutate:
        for mutant, code in _verdicts(workdir, path).items():
            if only is not None and not any(fnmatch.fnmatchcase(mutant, p) for p in only):
                continue
            report.generated += 1
            status = status_by_exit_code[code]
            if status == "killed":  # a test failed, or pytest stopped on the mutant
                report.killed += 1
            elif status == "survived":
                report.survivors.append(_describe(workdir, mutant))
            else:  # timeout (counted as killed by mutmut: the suite would hang), no tests, ...
                report.other[status] = report.other.get(status, 0) + 1
    return report


def _verdicts(workdir: Path, path: str) -> dict[str, int | None]:
    meta = json.loads((workdir / "mutants" / (path + ".meta")).read_text("utf-8"))
    verdicts: dict[str, int | None] = meta["exit_code_by_key"]
    return verdicts


def summary(report: Report) -> str:
    """Figures and every survivor, one per line, for the terminal and for RELIABILITY.md."""
    kinds = report.classify()
    head = (
        f"{report.campaign}: {report.generated} mutants, {report.killed} killed, "
        f"{len(report.survivors)} survived (message {len(kinds['message'])}, "
        f"log {len(kinds['log'])}, "
        f"equivalent {len(kinds['equivalent'])}, open {len(kinds['open'])}, "
        f"unexplained {len(kinds['new'])})"
    )
    stale = report.stale()
    if stale:
        head += f"; {len(stale)} stale survivors.toml entries"
    if report.other:
        head += " " + json.dumps(report.other)
    rows = [head]
    for kind in ("new", "open", "equivalent"):
        for s in kinds[kind]:
            rows.append(f"  [{kind}] {s.file}::{s.function}  {s.line}\n      {s.change}")
    for file, function, line, change in stale:
        rows.append(f"  [stale] {file}::{function}  {line}\n      {change}")
    return "\n".join(rows)


def unexplained_as_toml(report: Report) -> str:
    """Lines to paste into survivors.toml's ``survivor = [...]`` (a person sets kind and reason)."""
    out = []
    for s in report.classify()["new"]:
        fields = {"file": s.file, "function": s.function, "line": s.line, "change": s.change}
        fields |= {"kind": "open", "reason": "TODO"}
        inner = ", ".join(f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in fields.items())
        out.append(f"  {{ {inner} }},")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("campaigns", nargs="+", help=f"all, or some of {sorted(CAMPAIGNS)}")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it")
    parser.add_argument(
        "--recheck",
        type=Path,
        help="rerun only the survivors of a run kept in this folder, against today's tests",
    )
    parser.add_argument(
        "--changed-since",
        metavar="REV",
        help="only the mutants of functions whose code differs from git revision REV",
    )
    parser.add_argument("--toml", action="store_true", help="print unexplained as toml entries")
    args = parser.parse_args(argv)
    names = sorted(CAMPAIGNS) if args.campaigns == ["all"] else args.campaigns
    unknown = [n for n in names if n not in CAMPAIGNS]
    if unknown:
        parser.error(f"unknown campaign(s) {unknown}; known: {sorted(CAMPAIGNS)}")
    failed = False
    for name in names:
        campaign = CAMPAIGNS[name]
        started = time.monotonic()
        only = changed_functions(campaign, args.changed_since) if args.changed_since else None
        if args.recheck:
            report = recheck_survivors(
                campaign, workdir=args.recheck / name, max_children=args.max_children
            )
        elif args.keep:
            workdir = args.keep / name
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            report = run_campaign(
                campaign, workdir=workdir, max_children=args.max_children, only=only
            )
        else:
            with tempfile.TemporaryDirectory(prefix=f"mutation-{name}-") as tmp:
                report = run_campaign(
                    campaign, workdir=Path(tmp), max_children=args.max_children, only=only
                )
        print(summary(report), flush=True)
        print(f"  ({time.monotonic() - started:.0f} s)", flush=True)
        if args.toml:
            print(unexplained_as_toml(report))
        failed |= campaign.gated and bool(report.classify()["new"] or report.stale())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
