"""Bad input at every door: each gets a clear, coded error and changes nothing.

Generated (Hypothesis) and mutated inputs for every decoder and entry point:

* stored records (:func:`evlog.record.open_row`, :func:`evlog.events.decode_event`): garbage
  payloads under valid hashes, unknown types and schemas, broken links;
* log files through ``loraledger verify / replay / audit``: random bytes, a real log with
  flipped bytes, cut short -- an exit code and one message, never a traceback, and the file
  is byte-for-byte unchanged;
* CLI arguments: random options and values;
* commands: through ``decide`` with wrong types and out-of-range values (a ``LoraLedgerError``
  with a code, the state untouched), through msgspec decoding of commands (unknown fields,
  wrong types), and through the HTTP service (every POST route, random bodies and path
  parameters: a 4xx/5xx with a code, the state and ``last_seq`` untouched);
* engine replies: the SGLang and vLLM adapters (and the local engine's HTTP client) reading
  random bodies, wrong types, random statuses and huge bodies -- an ``EngineError`` (clean or
  ambiguous) or a well-typed value, nothing else;
* adapter files (:mod:`engines.artifacts`): corrupt safetensors, config/tensor mismatches,
  wrong digests, path traversal -- an ``ArtifactError`` with a code, the store unchanged;
* every HTTP route of the local engine's server and of ``loraledger serve``, on loopback, with
  generated bodies, headers and slow clients (``tests/fault/test_bad_input_http.py``, whose
  cases join the count below).

CI runs ``EXAMPLES`` examples per property, ``--slow`` ``SLOW_EXAMPLES``; the total number of
inputs tried is printed in the summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from engines.artifacts import ArtifactError, ArtifactStore, read_adapter_dir
from engines.contract import (
    Candidate,
    CleanRefusal,
    EngineError,
    ErrorCode,
    Generation,
    Inventory,
    SamplingParams,
)
from engines.local.client import LocalHTTPEngine
from engines.local.residency import resolve_under
from engines.local.tinymodel import make_adapter
from engines.manifest import build_manifest
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine
from evlog.errors import LoraLedgerError, StoreCode
from evlog.events import EVENT_TYPES, SessionBound, encode_event
from evlog.memory import MemoryStore
from evlog.record import GENESIS_HASH, Record, chain_hash, open_row
from evlog.sqlite import SQLiteStore
from projections.registry import RegistryState, encode_state
from publisher.core import commands as c
from publisher.core.decider import decide
from publisher.core.errors import Code
from publisher.core.ledger import Ledger
from tests.fault.conftest import record_figure
from tests.support.waiting import wait_for
from tools.cli import app
from tools.exitcodes import Exit
from tools.http_app import build_app
from tools.metrics import LedgerMetrics

EXAMPLES = 150
SLOW_EXAMPLES = 1500
TRIED: dict[str, int] = {}

pytestmark = [
    pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]


def _count(door: str) -> None:
    TRIED[door] = TRIED.get(door, 0) + 1


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    detail = ", ".join(f"{door} {n}" for door, n in TRIED.items())
    record_figure("bad inputs tried", f"{sum(TRIED.values())} ({detail})")


def _settings(slow: bool) -> settings:
    return settings(
        max_examples=SLOW_EXAMPLES if slow else EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )


# --- values a caller can get wrong -----------------------------------------------------------

_text = st.text(max_size=300) | st.sampled_from(
    ["", "a/b", "a:b", "..", "../../etc/passwd", "x" * 70, "\x00", "é", "agent@x-1-0123"]
)
_nasty = (
    st.none() | st.booleans() | _text | st.binary(max_size=40) | st.lists(st.integers(), max_size=3)
)
_numbers = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, -1, 2**63, True])
)
_any = _nasty | _numbers
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False)
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=20,
)


# --- stored records ---------------------------------------------------------------------------


def test_stored_records_that_do_not_decode_are_named_never_raised(slow: bool) -> None:
    """A row whose hash is right but whose content this code cannot read (garbage payload,
    another type's payload, unknown type, newer or older schema) is ``CORRUPT_RECORD`` or
    ``UNKNOWN_SCHEMA`` naming its seq; a row that does not match its hash or its predecessor
    is ``CORRUPT_RECORD`` / ``CHAIN_BROKEN``. Nothing else ever escapes."""
    known = sorted(EVENT_TYPES)
    payloads = (
        st.binary(max_size=200)
        | st.builds(msgspec.msgpack.encode, _json)
        | st.builds(
            lambda d, t: msgspec.msgpack.encode({"type": t, **d}),
            st.dictionaries(st.text(max_size=10), _json, max_size=4),
            st.sampled_from(known),
        )
        | st.just(encode_event(SessionBound(session="s", owner="w", version_id=1, revision=1)))
    )

    @_settings(slow)
    @given(
        type_name=st.sampled_from(known) | st.text(max_size=20),
        schema=st.integers(min_value=-3, max_value=5),
        payload=payloads,
        rehash=st.booleans(),
        prev_ok=st.booleans(),
    )
    def prop(type_name: str, schema: int, payload: bytes, rehash: bool, prev_ok: bool) -> None:
        _count("stored records")
        eid, stream, at = b"\x01" * 16, "controller", 1.0
        good = chain_hash(GENESIS_HASH, 1, eid, stream, type_name, schema, at, payload)
        stored_hash = good if rehash else bytes(32)
        prev = GENESIS_HASH if prev_ok else b"\x02" * 32
        if not prev_ok and rehash:
            stored_hash = chain_hash(prev, 1, eid, stream, type_name, schema, at, payload)
        row = (1, eid, stream, type_name, schema, at, payload, prev, stored_hash)
        try:
            record: Record | LoraLedgerError = open_row(row, 0, GENESIS_HASH)
        except LoraLedgerError as exc:
            record = exc
        if isinstance(record, LoraLedgerError):
            assert record.code in (
                StoreCode.CORRUPT_RECORD,
                StoreCode.CHAIN_BROKEN,
                StoreCode.UNKNOWN_SCHEMA,
            )
            assert record.details.get("seq") == 1
        else:
            assert type(record.event).__name__ == type_name

    prop()


# --- log files through the CLI --------------------------------------------------------------


@pytest.fixture(scope="module")
def small_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real, closed ledger log: deployment, two engines, one owner, sessions."""
    path = tmp_path_factory.mktemp("log") / "ledger.db"

    async def write() -> None:
        async with SQLiteStore.open(path) as store, Ledger.open(store) as ledger:
            await ledger.create_deployment("dep", prefix="agent", capacity=2)
            for e in ("e0", "e1"):
                await ledger.join_engine(e, f"{e}-1")
                await ledger.repair_engine(e, f"{e}-1")
            await ledger.register_owner("w", ttl_s=60)
            for i in range(3):
                await ledger.release(f"s{i}", "w")

    anyio.run(write)
    return path


_EXITS = {int(e) for e in Exit}


def _cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args, catch_exceptions=True)
    out = (result.stdout or "") + (result.stderr or "")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in out, out[-2000:]
    assert result.exit_code in _EXITS, (result.exit_code, out[-500:])
    return result.exit_code, out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent"


def test_damaged_log_files_get_an_exit_code_and_stay_untouched(
    small_log: Path, tmp_path_factory: pytest.TempPathFactory, slow: bool
) -> None:
    base = small_log.read_bytes()

    @_settings(slow)
    @given(
        kind=st.sampled_from(["random", "flip", "truncate", "empty"]),
        data=st.binary(min_size=0, max_size=4096),
        offsets=st.lists(st.integers(min_value=0, max_value=len(base) - 1), min_size=1, max_size=8),
        size=st.integers(min_value=0, max_value=len(base)),
        command=st.sampled_from(["verify", "replay", "audit"]),
    )
    def prop(kind: str, data: bytes, offsets: list[int], size: int, command: str) -> None:
        _count("log files")
        folder = tmp_path_factory.mktemp("bad")
        path = folder / "ledger.db"
        if kind == "random":
            content = data
        elif kind == "empty":
            content = b""
        elif kind == "truncate":
            content = base[:size]
        else:
            mutable = bytearray(base)
            for i in offsets:
                mutable[i] ^= 0xFF
            content = bytes(mutable)
        path.write_bytes(content)
        before = _digest(path)
        args = {
            "verify": ["verify", str(path), "--json"],
            "replay": ["replay", str(path), "--incidents", "--json"],
            "audit": ["audit", str(path), "--all", "--json"],
        }[command]
        _cli(args)
        assert _digest(path) == before, f"{command} changed the file it inspected"
        shutil.rmtree(folder, ignore_errors=True)

    prop()


_DEEP = b"\x91" * 100_000 + b"\xc0"  # a msgpack array nested 100,000 deep
_CRAFTED: dict[str, dict[str, object]] = {
    # (seq is the rowid: SQLite itself refuses any other type there)
    "deep nesting": {"payload": b"\x81\xa7session" + _DEEP},
    "deep nesting, old schema (upcast path)": {"payload": _DEEP, "schema": 0},
    "event_id as text": {"event_id": "id"},
    "stream as an integer": {"stream": 5},
    "type as a blob": {"type": b"SessionBound"},
    "schema as text": {"schema": "1"},
    "recorded_at as text": {"recorded_at": "yesterday"},
    "payload as text": {"payload": "abc"},
    "prev_hash as text": {"prev_hash": "x"},
    "hash as a number": {"hash": 7},
    "stream not UTF-8": {"stream": b"\xff\x00\xfe"},
    "type not UTF-8": {"type": b"Session\xffBound"},
}


@pytest.mark.parametrize("case", sorted(_CRAFTED))
def test_crafted_hash_valid_records_get_an_exit_code_naming_their_seq(
    small_log: Path, tmp_path: Path, case: str
) -> None:
    """Before: records whose hashes are right but whose content no ledger writes (nesting
    deeper than any event, a column of another type in a non-STRICT table, text that is not
    UTF-8) raised ``RecursionError``/``TypeError`` tracebacks, or ``STORE_FAILED`` with no
    seq. Each is ``CORRUPT_RECORD`` (exit 7) naming the record; ``verify --json`` prints its
    verdict; replay and audit name the seq; the file is unchanged."""
    from tests.tools import tamper

    _count("crafted records")
    log = tmp_path / "crafted.db"
    tamper.loose_copy(small_log, log)
    bad = 3
    columns = dict(_CRAFTED[case])
    if case.endswith("not UTF-8"):
        ((column, raw),) = columns.items()
        tamper.raw_text(log, bad, column, raw)  # type: ignore[arg-type]
    else:
        tamper.craft(log, bad, **columns)
    before = _digest(log)
    code, out = _cli(["verify", str(log), "--json"])
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    verdict = json.loads(lines[0])
    assert code == Exit.TAMPERED and verdict["exit_code"] == code, verdict
    assert verdict["code"] in ("CORRUPT_RECORD", "CHAIN_BROKEN"), verdict
    assert verdict["first_bad_seq"] == bad, verdict
    for args in (["replay", str(log), "--at", "2099-01-01"], ["audit", str(log), "--all"]):
        code, out = _cli(args)
        assert code == Exit.TAMPERED and f"(seq {bad})" in out, (args, out)
    assert _digest(log) == before


_MARKUP = ["[/x]", "[bold]", "[/]", "a[/b].db", "[link=https:x]y", "[red", "\\[x]"]


@pytest.mark.parametrize("text", _MARKUP)
def test_user_text_reaches_the_output_as_text_never_as_rich_markup(
    small_log: Path, tmp_path: Path, text: str
) -> None:
    """Before: ``loraledger replay 'missing[/x].db'`` was a ``MarkupError`` traceback
    (exit 1 instead of 3). Paths, names given on the command line and names read from the
    log are printed verbatim, in answers and in error lines."""
    from evlog.events import DeploymentCreated
    from tests.tools import tamper

    cases: list[tuple[list[str], int]] = [
        (["replay", str(tmp_path / f"missing{text}.db")], Exit.MISSING),
        (["verify", str(tmp_path / f"missing{text}.db")], Exit.MISSING),
        (["replay", str(small_log), "--engine", text, "--version", "1"], Exit.OK),
        (["audit", str(small_log), "--session", text], Exit.FAILED),
        (["audit", str(small_log), "--all", "--provenance", str(tmp_path / text)], Exit.MISSING),
    ]
    forged = tmp_path / "forged.db"
    shutil.copyfile(small_log, forged)
    with closing(sqlite3.connect(forged)) as conn:
        (created,) = conn.execute(
            "SELECT seq FROM events WHERE type = 'DeploymentCreated'"
        ).fetchone()
    tamper.reforge(forged, created, DeploymentCreated(deployment=text, prefix=text, capacity=2))
    cases.append((["replay", str(forged)], Exit.OK))
    for args, expected in cases:
        _count("cli output")
        code, out = _cli(args)
        assert code == expected, (args, out)
        assert text in out, (args, out)


def test_serve_refuses_a_bad_deployment_name_before_creating_anything(tmp_path: Path) -> None:
    """Before: ``serve --deployment 'a b/c'`` created the log and its artifacts folder,
    started, and ended in an ``ExceptionGroup``. The name is checked first: usage error, one
    line, nothing on disk."""
    for name in ("a b/c", "", "-x", "x" * 65, "a:b", "[/x]"):
        _count("cli output")
        db = tmp_path / "serve" / "ledger.db"
        code, out = _cli(["serve", "--db", str(db), "--deployment", name, "--port", "0"])
        assert code == Exit.USAGE and "--deployment" in out, (name, out)
        assert not db.parent.exists() and not db.exists(), name
    _count("cli output")
    code, out = _cli(["serve", "--db", str(db), "--prefix", "a/b", "--port", "0"])
    assert code == Exit.USAGE and "--prefix" in out and not db.parent.exists()


def test_replay_plot_to_an_unwritable_path_is_one_line_and_a_code(
    small_log: Path, tmp_path: Path
) -> None:
    """Before: ``replay --plot /nonexistent/x.png`` was an internal error. Now an unwritable
    plot path is one line and the exit code that says why."""
    pytest.importorskip("matplotlib")
    for target, expected, why in (
        (tmp_path / "nonexistent" / "x.png", Exit.USAGE, "no such directory"),
        (tmp_path, Exit.FAILED, "cannot write"),
    ):
        _count("cli output")
        code, out = _cli(["replay", str(small_log), "--plot", str(target)])
        assert code == expected and why in out and "internal error" not in out, out


def test_replay_into_a_closed_pipe_exits_quietly(small_log: Path) -> None:
    """Before: ``loraledger replay LOG | head`` printed "internal error: BrokenPipeError".
    Like a Unix tool killed by SIGPIPE: nothing on stderr, exit 141 (128 + 13). The reader
    closes its end before the command writes (its start-up alone takes far longer than
    ``close``), so the first write meets a closed pipe, every time."""
    from tests.support.paths import REPO
    from tests.tools.conftest import console_script, script_env

    for args in (["replay", str(small_log)], ["replay", str(small_log), "--json"]):
        _count("cli output")
        child = subprocess.Popen(
            [*console_script(), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env=script_env(),
        )
        assert child.stdout is not None and child.stderr is not None
        child.stdout.close()
        err = child.stderr.read().decode()
        assert child.wait(timeout=120) == Exit.BROKEN_PIPE, err
        assert err == "", err


def test_cli_arguments_get_an_exit_code_never_a_traceback(small_log: Path, slow: bool) -> None:
    options = st.sampled_from(
        [
            "--seq",
            "--at",
            "--version",
            "--engine",
            "--stuck-after",
            "--pinned-top",
            "--session",
            "--owner",
            "--all",
            "--deep",
            "--json",
            "--incidents",
            "--provenance",
            "--plot",
            "-v",
            "--url",
            "--timeout",
            "--port",
            "--capacity",
            "--bogus",
        ]
    )
    values = st.sampled_from(
        [
            "-1",
            "0",
            "1",
            "99999999999999999999",
            "nan",
            "1e309",
            "2026-13-40",
            "yesterday",
            "10x",
            "",
            "e0",
            "../x",
            str(small_log),
            "/nonexistent",
        ]
    ) | st.text(max_size=15)
    commands = st.sampled_from(["verify", "replay", "audit", "status", "nonsense"])

    @_settings(slow)
    @given(command=commands, rest=st.lists(options | values, max_size=6), with_log=st.booleans())
    def prop(command: str, rest: list[str], with_log: bool) -> None:
        _count("cli arguments")
        if command == "status":
            rest = [*rest, "--url", "http://127.0.0.1:9", "--timeout", "0.2"]  # nothing listens
        args = [command, *([str(small_log)] if with_log and command != "status" else []), *rest]
        before = _digest(small_log)
        _cli([a for a in args if "\x00" not in a])
        assert _digest(small_log) == before

    prop()


# --- commands ---------------------------------------------------------------------------------


def _fields(cls: type[c.Command]) -> list[str]:
    return [f for f in cls.__struct_fields__ if f != "command_id"]


def _serving_state() -> RegistryState:
    """A state with a deployment, two routable engines, a published version, an owner and a
    bound session: every handler has something to refuse against."""

    async def build() -> RegistryState:
        async with Ledger.open(MemoryStore()) as ledger:
            await ledger.create_deployment("dep", prefix="agent", capacity=3)
            for e in ("e0", "e1"):
                await ledger.join_engine(e, f"{e}-1")
                await ledger.repair_engine(e, f"{e}-1")
            digest = "ab" * 32
            allocated = await ledger.allocate(1, digest)
            assert hasattr(allocated, "lora_name")
            await ledger.claim_transport(1, 1, "p")
            for e in ("e0", "e1"):
                await ledger.record_prepared(1, 1, e, f"{e}-1", digest, allocated.lora_name)
                await ledger.record_ready(1, 1, e, f"{e}-1", digest, allocated.lora_name)
            await ledger.commit(1, 1)
            await ledger.register_owner("w", ttl_s=60)
            await ledger.bind("s1", "w")
            return ledger.state

    return anyio.run(build)


def test_decide_refuses_wrong_types_and_out_of_range_values_with_a_code(slow: bool) -> None:
    """Commands built in Python are not type-checked by their constructor (msgspec structs),
    so the decider sees whatever a caller passes. It must answer a ``LoraLedgerError`` with a code
    (or a legitimate outcome), never raise, and never touch the state it read."""
    state = _serving_state()
    before = encode_state(state)
    kinds = sorted(
        (cls for cls in c.Command.__subclasses__() if cls is not c.StartController),
        key=lambda k: k.__name__,
    )

    @_settings(slow)
    @given(cls=st.sampled_from(kinds), data=st.data())
    def prop(cls: type[c.Command], data: st.DataObject) -> None:
        _count("commands (decide)")
        kwargs: dict[str, Any] = {f: data.draw(_any, label=f) for f in _fields(cls)}  # any junk
        command = cls(**kwargs)
        decision = decide(state, command)
        if decision.error is not None:
            assert isinstance(decision.error, LoraLedgerError) and decision.error.code
        assert encode_state(state) == before

    prop()


def test_the_ledger_refuses_bad_commands_and_keeps_serving(slow: bool) -> None:
    """The same commands through a running :class:`Ledger` (its single writer decides them):
    a refusal is a ``LoraLedgerError`` with a code, the state and the log are as they were (a
    refused engine receipt is the one refusal recorded, as ``ReceiptRejected``), and
    the ledger still serves the next caller."""
    kinds = sorted(
        (cls for cls in c.Command.__subclasses__() if cls is not c.StartController),
        key=lambda k: k.__name__,
    )

    async def run(commands: list[c.Command]) -> None:
        store = MemoryStore()
        async with Ledger.open(store) as ledger:
            await ledger.create_deployment("dep", prefix="agent", capacity=2)
            await ledger.register_owner("w", ttl_s=60)
            for i, command in enumerate(commands):
                await _settle(ledger)
                state, seq = encode_state(ledger.state), store.last_seq
                refusal: LoraLedgerError | None = None
                try:
                    await ledger.execute(command)
                except LoraLedgerError as exc:
                    refusal = exc
                if refusal is not None:
                    assert refusal.code and refusal.code != Code.LEDGER_CLOSED, refusal
                    await _settle(ledger)
                    types = [r.type for r in await store.read(after=seq)]
                    assert types in ([], ["ReceiptRejected"]), types
                    if not types:
                        assert encode_state(ledger.state) == state
                assert (await ledger.release(f"probe-{i}", "w")).released is False

    @_settings(slow)
    @given(st.lists(st.tuples(st.sampled_from(kinds), st.data()), min_size=1, max_size=4))
    def prop(drawn: list[tuple[type[c.Command], st.DataObject]]) -> None:
        commands = []
        for cls, data in drawn:
            _count("commands (ledger)")
            junk: dict[str, Any] = {f: data.draw(_any, label=f) for f in _fields(cls)}
            commands.append(cls(**junk))
        anyio.run(run, commands)

    prop()


@pytest.mark.anyio
async def test_an_ill_typed_command_is_refused_and_the_ledger_goes_on() -> None:
    """``Forget(sessions=None)`` (a Python caller's mistake; struct constructors do not check
    types) is refused ``INVALID_INPUT``, nothing is recorded, and the ledger still serves.
    Before the fix it raised a TypeError inside the decider, which stopped the ledger's single
    writer: every later command of every caller got LEDGER_CLOSED."""
    async with Ledger.open(MemoryStore()) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=2)
        await ledger.register_owner("w", ttl_s=60)
        seq = ledger.state.last_seq
        with pytest.raises(LoraLedgerError) as refused:
            await ledger.execute(c.Forget(sessions=None))  # type: ignore[arg-type]
        assert refused.value.code == Code.INVALID_INPUT
        assert ledger.state.last_seq == seq
        assert (await ledger.release("s1", "w")).released is False  # still serving


@pytest.mark.anyio
async def test_an_ill_typed_value_is_refused_before_it_is_stored() -> None:
    """``join_engine(..., endpoint=5)`` is refused ``INVALID_INPUT`` before anything is
    written. Before the fix it was stored as ``EngineJoined(endpoint=5)``, a payload that then
    failed its own schema on every read: the log could no longer be replayed (CORRUPT_RECORD at
    that seq, forever)."""
    store = MemoryStore()
    async with Ledger.open(store) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=2)
        with pytest.raises(LoraLedgerError) as refused:
            await ledger.join_engine("e0", "i1", endpoint=5)  # type: ignore[arg-type]
        assert refused.value.code == Code.INVALID_INPUT
        await ledger.join_engine("e0", "i1", endpoint="http://127.0.0.1:1")
    assert [r.type for r in await store.read()][-1] == "EngineJoined"


@pytest.mark.anyio
async def test_a_renewal_with_malformed_inflight_counts_is_refused_and_renews_nothing() -> None:
    """The in-flight counts a renewal reports (``Ledger.renew_lease``, ``POST
    /owners/{owner}/renew``) must be whole, non-negative counts, each for a named engine and a
    version id of at least 1: anything else is refused ``INVALID_INPUT``, nothing renewed.
    Before the fix a count of -7 was accepted; the reclaim driver sums every reporter's counts,
    so it could cancel another worker's running request (an unload under it), or hold a
    version forever."""
    async with Ledger.open(MemoryStore()) as ledger:
        await ledger.create_deployment("dep", prefix="agent", capacity=2)
        await ledger.register_owner("w", ttl_s=60)
        for bad in ({("e0", 1): -7}, {("e0", 0): 1}, {("", 1): 1}, {("e0", 1): True}):
            with pytest.raises(LoraLedgerError) as refused:
                ledger.renew_lease("w", bad)
            assert refused.value.code == Code.INVALID_INPUT
        assert ledger.inflight_evidence(1)[0].count == 0
        ledger.renew_lease("w", {("e0", 1): 2})
        assert ledger.inflight_evidence(1)[0].count == 2


def test_commands_decoded_from_the_wire_are_typed_or_refused(slow: bool) -> None:
    """msgspec decoding of the command union: unknown fields, unknown tags and wrong types are
    ``ValidationError``/``DecodeError`` at the door; what decodes is decided with a code."""
    state = _serving_state()
    before = encode_state(state)
    decoder = msgspec.json.Decoder(c.AnyCommand)
    tags = sorted(cls.__name__ for cls in c.Command.__subclasses__())

    @_settings(slow)
    @given(
        tag=st.sampled_from(tags) | st.text(max_size=10),
        body=st.dictionaries(
            st.sampled_from(
                [
                    "session",
                    "owner",
                    "version_id",
                    "digest",
                    "engine",
                    "incarnation",
                    "attempt",
                    "adapters",
                    "sessions",
                    "capacity",
                    "deployment",
                    "prefix",
                    "ttl_s",
                    "now",
                    "evidence",
                    "extra",
                ]
            )
            | st.text(max_size=8),
            _json,
            max_size=6,
        ),
    )
    def prop(tag: str, body: dict[str, Any]) -> None:
        _count("commands (wire)")
        raw = json.dumps({"type": tag, **body}).encode()
        try:
            command = decoder.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        if isinstance(command, c.StartController):
            return
        decision = decide(state, command)
        assert decision.error is None or decision.error.code
        assert encode_state(state) == before

    prop()


def test_the_service_refuses_bad_requests_with_a_code_and_changes_nothing(slow: bool) -> None:
    """Every POST route of ``loraledger serve`` with random bodies and path parameters: an
    error answer is 4xx/5xx JSON with a code and leaves the state and the log as they were."""
    routes = [
        "/owners",
        "/owners/{p}/renew",
        "/sessions/{p}/bind",
        "/sessions/{p}/release",
        "/versions",
    ]

    async def run(cases: list[tuple[str, str, bytes]]) -> None:
        async with Ledger.open(MemoryStore()) as ledger:
            await ledger.create_deployment("dep", prefix="agent", capacity=2)
            await ledger.register_owner("w", ttl_s=60)
            app_ = build_app(ledger, LedgerMetrics(lambda: ledger.state, []), token="t")
            transport = httpx.ASGITransport(app=app_)
            async with httpx.AsyncClient(transport=transport, base_url="http://svc") as client:
                for route, param, body in cases:
                    await _settle(ledger)
                    state_before, seq_before = encode_state(ledger.state), ledger.store.last_seq
                    response = await client.post(
                        route.replace("{p}", param),
                        content=body,
                        headers={"authorization": "Bearer t", "content-type": "application/json"},
                    )
                    assert response.status_code < 500 or response.status_code == 503, response.text
                    routed = response.headers.get("content-type") == "application/json"
                    if response.status_code != 200:
                        # an unroutable path (``/owners//renew``) is the router's plain 404
                        assert routed or response.status_code == 404, response.text
                        assert not routed or response.json()["code"], response.text
                        await _settle(ledger)
                        assert encode_state(ledger.state) == state_before
                        assert ledger.store.last_seq == seq_before
                    for lease in ledger.leases._leases.values():
                        assert all(
                            isinstance(n, int) and n >= 0 for n in lease.inflight.values()
                        ), lease

    renewals = st.tuples(
        st.just("/owners/{p}/renew"),
        st.just("w"),
        st.builds(
            lambda e, v, n: json.dumps(
                {"inflight": [{"engine": e, "version_id": v, "count": n}]}
            ).encode(),
            st.text(max_size=4),
            st.integers(-5, 5),
            st.integers(-(2**63), 2**63),
        ),
    )

    @_settings(slow)
    @given(
        st.lists(
            renewals
            | st.tuples(
                st.sampled_from(routes),
                st.sampled_from(["w", "s1", "", "%20", "x" * 300, "..", "a%2Fb"])
                | st.text(alphabet="abc-_.~", max_size=8),
                st.builds(lambda j: json.dumps(j).encode(), _json)
                | st.builds(
                    lambda o, t: json.dumps({"owner": o, "ttl_s": t}).encode(), _json, _json
                )
                | st.builds(
                    lambda e, v, n: json.dumps(
                        {"inflight": [{"engine": e, "version_id": v, "count": n}]}
                    ).encode(),
                    _json,
                    _json,
                    _json,
                )
                | st.builds(
                    lambda v, d: json.dumps({"version_id": v, "adapter_dir": d}).encode(),
                    _json,
                    _json,
                )
                | st.binary(max_size=64),
            ),
            min_size=1,
            max_size=8,
        )
    )
    def prop(cases: list[tuple[str, str, bytes]]) -> None:
        for _ in cases:
            _count("service requests")
        anyio.run(run, cases)

    prop()


async def _settle(ledger: Ledger) -> None:
    await wait_for(
        "the store to hold every event the ledger decided",
        lambda: ledger.store.last_seq >= ledger.state.last_seq,
        every=0.001,
    )


# --- engine replies ---------------------------------------------------------------------------

_ENGINE_CODES = {v for k, v in vars(ErrorCode).items() if k.isupper()}


def _candidate(root: Path) -> Candidate:
    config, tensors = make_adapter(1)
    manifest = build_manifest(config, tensors)
    store = ArtifactStore(root)
    path = store.put(manifest, tensors)
    return Candidate(
        lora_name="agent@dep-1-" + manifest.digest[:16],
        digest=manifest.digest,
        attempt=1,
        manifest=manifest,
        artifact_path=str(path),
    )


def test_engine_adapters_read_any_reply_as_a_value_or_an_engine_error(
    tmp_path: Path, slow: bool
) -> None:
    candidate = _candidate(tmp_path / "artifacts")
    params = SamplingParams(max_tokens=3)
    bodies = (
        st.builds(lambda j: json.dumps(j).encode(), _json)
        | st.binary(max_size=200)
        | st.just(b"{" * 10_000)
        | st.just(json.dumps({"data": [{"id": "x" * 100_000}]}).encode())
        | st.builds(lambda j: json.dumps({"data": j, "object": "list"}).encode(), _json)
        | st.builds(
            lambda j: json.dumps({"text": j, "output_ids": j, "meta_info": j}).encode(), _json
        )
        | st.builds(lambda j: json.dumps({"choices": j, "usage": j}).encode(), _json)
        | st.builds(lambda j: json.dumps({"incarnation": j, "startup_time": j}).encode(), _json)
        | st.builds(lambda j: json.dumps({"error": j}).encode(), _json)
    )
    statuses = st.sampled_from([200, 200, 200, 201, 204, 400, 404, 409, 422, 500, 503, 302])

    async def one(kind: str, method: str, status: int, body: bytes) -> None:
        def reply(request: httpx.Request) -> httpx.Response:
            return httpx.Response(status, content=body)

        client = httpx.AsyncClient(transport=httpx.MockTransport(reply), base_url="http://engine")
        if kind == "sglang":
            engine: Any = SGLangEngine("http://engine", "e0", client=client)
        elif kind == "vllm":
            engine = VLLMEngine("http://engine", "e0", max_lora_rank=64, client=client)
        else:
            engine = LocalHTTPEngine("http://engine", "e0", client=client)
        calls: dict[str, Callable[[], Any]] = {
            "incarnation": engine.incarnation,
            "inventory": engine.inventory,
            "prepare": lambda: engine.prepare(candidate),
            "load": lambda: engine.load(candidate),
            "unload": lambda: engine.unload(candidate.lora_name, attempt=1),
            "generate": lambda: engine.generate((1, 2, 3), candidate.lora_name, params),
        }
        try:
            with anyio.fail_after(10):
                value = await calls[method]()
        except EngineError as exc:
            value = exc
        finally:
            await client.aclose()
        if isinstance(value, EngineError):
            assert value.code in _ENGINE_CODES, value
            return
        expected = {"incarnation": str, "inventory": Inventory, "generate": Generation}
        if method in expected:
            assert isinstance(value, expected[method]), (method, value)
        if isinstance(value, Inventory):
            assert all(isinstance(a.lora_name, str) for a in value.adapters)
        if isinstance(value, Generation):
            assert all(isinstance(t, int) for t in value.token_ids)
            assert isinstance(value.text, str)

    @_settings(slow)
    @given(
        kind=st.sampled_from(["sglang", "vllm", "local"]),
        method=st.sampled_from(
            ["incarnation", "inventory", "prepare", "load", "unload", "generate"]
        ),
        status=statuses,
        body=bodies,
    )
    def prop(kind: str, method: str, status: int, body: bytes) -> None:
        _count("engine replies")
        anyio.run(one, kind, method, status, body)

    prop()


# --- adapter files ----------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_adapter_files_are_refused_with_a_code(tmp_path: Path, slow: bool) -> None:
    config, tensors = make_adapter(1)
    manifest = build_manifest(config, tensors)
    store = ArtifactStore(tmp_path / "store")
    good = store.put(manifest, tensors)
    weights = (good / "adapter_model.safetensors").read_bytes()
    config_bytes = (good / "adapter_config.json").read_bytes()
    scratch = tmp_path / "scratch"
    codes: set[str] = set()

    @_settings(slow)
    @given(
        what=st.sampled_from(["weights", "config", "both", "resolve", "path_for", "put"]),
        blob=st.binary(max_size=512),
        flips=st.lists(st.integers(min_value=0, max_value=len(weights) - 1), max_size=6),
        cut=st.integers(min_value=0, max_value=len(weights)),
        doc=_json,
        name=_text,
    )
    def prop(what: str, blob: bytes, flips: list[int], cut: int, doc: Any, name: str) -> None:
        _count("adapter files")
        before = _tree(store.root)
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        w = bytearray(weights[:cut] if cut % 3 == 0 else weights)
        for i in flips:
            if i < len(w):
                w[i] ^= 0x5A
        try:
            if what == "resolve":
                store.resolve(name)
                return
            if what == "path_for":
                store.path_for(name)
                return
            if what == "put":
                bad = msgspec.structs.replace(manifest, digest=hashlib.sha256(blob).hexdigest())
                store.put(bad, tensors)
                raise AssertionError("a manifest with another digest was stored")
            (scratch / "adapter_model.safetensors").write_bytes(
                bytes(w) if what in ("weights", "both") else (blob if what == "config" else weights)
            )
            (scratch / "adapter_config.json").write_bytes(
                json.dumps(doc).encode() if what in ("config", "both") else config_bytes
            )
            read_adapter_dir(scratch)
        except ArtifactError as exc:
            codes.add(exc.code)
        assert _tree(store.root) == before, "a refused input changed the artifact store"
        assert codes <= {"INVALID_ADAPTER", "DIGEST_MISMATCH", "PATH_OUTSIDE_STORE"}, codes

    prop()


def test_a_path_outside_the_artifact_root_is_refused(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    for path in ("../x", "/etc", "a/../../b", str(tmp_path), os.fspath(store.root / ".." / "y")):
        _count("adapter files")
        with pytest.raises(ArtifactError) as caught:
            store.resolve(path)
        assert caught.value.code == "PATH_OUTSIDE_STORE"


def test_a_path_with_a_nul_byte_is_outside_the_store(tmp_path: Path) -> None:
    """An engine-supplied adapter path with a NUL byte is refused ``PATH_OUTSIDE_STORE`` by
    ``ArtifactStore.resolve`` and by the local engine's path check. Before the fix
    ``Path.resolve`` raised a bare ``ValueError`` out of both, which a publication then took
    for an ambiguous engine failure."""
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(ArtifactError) as refused:
        store.resolve("abc\x00def")
    assert refused.value.code == "PATH_OUTSIDE_STORE"
    for root in (None, store.root):
        with pytest.raises(CleanRefusal) as clean:
            resolve_under(root, "x\x00y")
        assert clean.value.code == ErrorCode.PATH_OUTSIDE_STORE
