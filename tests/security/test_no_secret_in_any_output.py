"""No password or token appears in any output of any command: every ``loraledger`` command run
as a real process, with known secrets planted everywhere a secret can enter, on its success
path, its ``--json`` path and its error paths; then every file of the run (stdout, stderr,
the provenance JSON lines, the logs, the SQLite log itself) is grepped for each secret, as
written, percent-encoded and base64'd (:func:`tests.security.runs.giveaways`).

Where secrets enter: the ledger's token (``--token-file`` with a rotated token on a comment
line, ``LORALEDGER_TOKEN``, ``--token`` on argv), the engine's token (``--engine-token-file``,
``LORALEDGER_ENGINE_TOKEN``, ``--api-key-file``), the agent's own token, a wrong token a user
typed, a password in the user part of an ``http://`` service URL (``--url``, ``--ledger``,
``$LORALEDGER_URL``), and a PostgreSQL log's passwords (user part and ``?password=``,
percent-encoded) on a real throwaway server, whose trust rules are changed so that one role
needs a password the command gets wrong.

Commands run, with the paths each takes:

* ``engine``: listening (token file), and refused (a token file without a token);
* ``serve``: listening on SQLite with both token files (``-v``: every probe logged), on
  PostgreSQL (``--json`` and text, ``-v``); holding a wrong engine token (the engine answers
  401, logged); refused: a password the server refuses, a URL that does not parse, an unknown
  scheme (one with ``--token`` on argv), an engine URL with a password;
* ``agent``: listening with its own token and the engine's; an engine that answers 401 to the
  engine token it holds; refused without a token of its own (exit 11);
* ``check-engine``: an engine that answers 401 to its API key;
* ``gateway``: listening and serving a turn (both token files, ``--provenance``); a ledger that
  refuses its token; a ledger URL with a password (refused); a ledger that cannot be reached;
* ``status``, ``fleet suspend|resume|remove``: token by file, environment and argv; ``--json``;
  a wrong token; an unknown engine; a ledger that cannot be reached; a URL with a password;
* ``publish --url`` and ``publish`` reading ``$LORALEDGER_URL``: a publication (``--json``), a
  wrong token, a ledger that cannot be reached;
* ``verify``, ``replay``, ``audit``: on the SQLite log and the PostgreSQL one (text and
  ``--json``), and refused (the password refused, a URL that does not parse).

Left out: ``demo`` (takes no secret: no token, URL or store option; its gateways use a fixed
token of its own on loopback) and ``bench`` (minutes of work, and it takes no secret either:
``--store postgres`` starts its own password-less throwaway server), and ``check-engine``'s
success path (a minute of loads, long generations and a restart; its key is read and sent by
the same code as on the 401 path run here).

Before: ``replay``'s text title and ``audit``'s "no session matches" error printed a
PostgreSQL log's URL as given, both passwords in it; a service URL with a password was
accepted (``status`` answered; the gateway failed with ``LEDGER_ANSWER: http://operator:<the
password>@…/owners answered HTTP 401``: the client sends the URL's password as Basic
credentials in place of the token) and an engine URL with one was recorded in the log."""

from __future__ import annotations

import functools
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import anyio
import httpx
import pytest

from engines.artifacts import serialize_safetensors
from engines.local.tinymodel import make_adapter
from tests.security.runs import assert_no_secret_in, command, listening
from tests.support.fixtures import run_blocking
from tests.support.waiting import wait_for
from tools.exitcodes import Exit
from tools.pg_server import PostgresServer, create_database

LEDGER_TOKEN = "ledgerTok!live-5b2e"
OLD_LEDGER_TOKEN = "ledgerTok!rotated-9d4c"
WRONG_TOKEN = "wrongTok!typo-3a7f"
ENGINE_TOKEN = "engineTok!live-1c8a"
OLD_ENGINE_TOKEN = "engineTok!rotated-6e0b"
AGENT_TOKEN = "agentTok!live-4f9d"
URL_PASSWORD = "urlPass!word-2d6b"
PG_USER_PASSWORD = "pgUser!s3cret-8a1c"
PG_QUERY_PASSWORD = "pgQuery!s3cret-0f5e"
PG_WRONG_PASSWORD = "pgWrong!s3cret-7b3d"
SECRETS = (
    LEDGER_TOKEN,
    OLD_LEDGER_TOKEN,
    WRONG_TOKEN,
    ENGINE_TOKEN,
    OLD_ENGINE_TOKEN,
    AGENT_TOKEN,
    URL_PASSWORD,
    PG_USER_PASSWORD,
    PG_QUERY_PASSWORD,
    PG_WRONG_PASSWORD,
)


@dataclass(frozen=True)
class Fleet:
    """A running engine and ``serve`` in front of it. ``run`` holds every output; the token
    files live in ``keys``, outside it (they hold the secrets on purpose)."""

    run: Path
    keys: Path
    url: str
    engine_url: str

    def key(self, name: str) -> str:
        return str(self.keys / name)


def _with_password(url: str, password: str = URL_PASSWORD) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://operator:{quote(password, safe='!')}@{rest}"


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, read, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    keys = tmp_path_factory.mktemp("keys")
    run = tmp_path_factory.mktemp("run")
    (keys / "ledger").write_text(f"# the ledger\n{LEDGER_TOKEN} live\n# {OLD_LEDGER_TOKEN}\n")
    (keys / "engine").write_text(f"{ENGINE_TOKEN}\n# rotated: {OLD_ENGINE_TOKEN}\n")
    (keys / "agent").write_text(f"{AGENT_TOKEN}\n")
    (keys / "wrong").write_text(f"{WRONG_TOKEN}\n")
    (keys / "empty").write_text("# no token yet\n")
    engine_args = ["engine", "--id", "e0", "--port", "0", "--json"]
    with listening(run, "engine", *engine_args, "--token-file", str(keys / "engine")) as (
        _,
        engine,
    ):
        assert isinstance(engine, dict)
        with listening(
            run,
            "serve",
            "-v",
            "serve",
            "--db",
            str(run / "ledger.db"),
            "--port",
            "0",
            "--engine",
            f"e0=local:{engine['url']}",
            "--engine-token-file",
            str(keys / "engine"),
            "--token-file",
            str(keys / "ledger"),
            "--provenance",
            str(run / "serve-provenance.jsonl"),
            "--json",
        ) as (_, serve):
            assert isinstance(serve, dict)
            yield Fleet(run, keys, str(serve["url"]), str(engine["url"]))


def _routable(url: str, engine: str) -> bool:
    reply = httpx.get(
        f"{url}/status",
        headers={"authorization": f"Bearer {LEDGER_TOKEN}"},
        timeout=30,
        trust_env=False,
    )
    reply.raise_for_status()
    return any(e["engine"] == engine and e["routable"] for e in reply.json()["engines"])


def _adapter(where: Path, seed: int) -> Path:
    config, tensors = make_adapter(seed)
    where.mkdir()
    (where / "adapter_config.json").write_text(json.dumps(config))
    (where / "adapter_model.safetensors").write_bytes(serialize_safetensors(tensors))
    return where


Runs = dict[str, tuple[int, tuple[str, ...], dict[str, str]]]


def _runs(run: Path, expected: Runs, *, at_once: int = 4) -> None:
    """Each ``name: (exit code, argv, environment)`` run to completion, ``at_once`` of them at a
    time (so only runs that do not depend on each other share a call), its exit code checked
    (``-1``: any failure)."""

    def one(name: str) -> None:
        code, args, env = expected[name]
        done = command(run, name, *args, timeout=180, **env)
        wanted = done.returncode != 0 if code == -1 else done.returncode == code
        assert wanted, (name, done.returncode, done.stdout[-2000:], done.stderr[-2000:])

    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(one, expected))  # list(): the first failure is raised here


OK, FAILED, USAGE = Exit.OK, -1, Exit.USAGE
NO_ENV: dict[str, str] = {}


def test_the_clients_of_a_running_ledger(fleet: Fleet) -> None:
    """status, fleet, publish and gateway against a real serve: every way a token or a URL
    password enters, each success, --json and error path; then verify, replay and audit on
    the log serve wrote."""
    run, url = fleet.run, fleet.url
    by_file = ("--url", url, "--token-file", fleet.key("ledger"))
    wrong = ("--url", url, "--token-file", fleet.key("wrong"))
    down = f"127.0.0.1:{_closed_port()}"
    with_password = _with_password(url)
    env = {"LORALEDGER_TOKEN": LEDGER_TOKEN}
    adapter = str(_adapter(run / "adapter-1", 1))
    _runs(
        run,
        {
            "status-file": (OK, ("status", *by_file, "--json"), NO_ENV),
            "status-env": (OK, ("status", "--url", url), env),
            "status-down": (Exit.UNREACHABLE, ("status", "--url", f"http://{down}"), env),
            "status-userinfo": (USAGE, ("status", "--url", with_password, "--json"), env),
            "remove-unknown": (FAILED, ("fleet", "remove", "e9", *by_file, "--json"), NO_ENV),
            "suspend-wrong": (FAILED, ("fleet", "suspend", "e0", *wrong), NO_ENV),
            "suspend-wrong-argv": (
                FAILED,
                ("fleet", "suspend", "e0", "--url", url, "--token", WRONG_TOKEN, "--json"),
                NO_ENV,
            ),
            "suspend-userinfo": (USAGE, ("fleet", "suspend", "e0", "--url", with_password), env),
            "publish-wrong": (FAILED, ("publish", adapter, "--version", "2", *wrong), NO_ENV),
            "publish-down": (
                Exit.UNREACHABLE,
                ("publish", adapter, "--version", "2", "--retry-for", "0.5", "--json"),
                {**env, "LORALEDGER_URL": f"http://{down}"},
            ),
            "publish-userinfo": (
                USAGE,
                ("publish", adapter, "--version", "2"),
                {**env, "LORALEDGER_URL": with_password},
            ),
        },
    )
    _runs(
        run,
        {
            "suspend": (OK, ("fleet", "suspend", "e0", *by_file, "--json"), NO_ENV),
            "resume": (OK, ("fleet", "resume", "e0", "--url", url), env),
        },
        at_once=1,  # in this order
    )
    # A resumed engine serves again once the reconciler repaired it; until then a
    # publication has no engine to go to (FLEET_MISMATCH), and the turn below needs v1 on it.
    anyio.run(
        functools.partial(
            wait_for,
            "e0 routable again after its resume",
            functools.partial(_routable, url, "e0"),
            timeout=120,
            every=0.1,
        )
    )
    _runs(
        run, {"publish": (OK, ("publish", adapter, "--version", "1", *by_file, "--json"), NO_ENV)}
    )
    gateway = ("-v", "gateway", "--port", "0", "--engine-token-file", fleet.key("engine"))
    provenance = ("--provenance", str(run / "gateway-provenance.jsonl"))
    with listening(run, "gateway", *gateway, *provenance, "--ledger", *by_file[1:], "--json") as (
        _,
        row,
    ):
        assert isinstance(row, dict)
        turn = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        reply = httpx.post(
            f"{row['url']}/v1/chat/completions",
            json=turn,
            headers={"authorization": f"Bearer {LEDGER_TOKEN}", "x-session-id": "s-1"},
            timeout=120,
            trust_env=False,
        )
        assert reply.status_code == 200, reply.text
        (run / "gateway-turn.json").write_bytes(reply.content)
    with listening(run, "gateway-text", *gateway, "--ledger", *by_file[1:], json_row=False):
        pass
    _runs(
        run,
        {
            "gateway-wrong": (FAILED, (*gateway, "--ledger", *wrong[1:]), NO_ENV),
            "gateway-down": (Exit.UNREACHABLE, (*gateway, "--ledger", f"http://{down}"), env),
            "gateway-userinfo": (USAGE, (*gateway, "--ledger", with_password, "--json"), env),
            "serve-engine-userinfo": (
                USAGE,
                ("serve", "--port", "0", "--engine", f"e1=sglang:{_with_password(url)}"),
                NO_ENV,
            ),
        },
    )
    db = str(run / "ledger.db")  # the log serve wrote, with the turn's session in it
    _runs(
        run,
        {
            "verify-json": (OK, ("verify", db, "--json"), env),
            "replay": (OK, ("replay", db, "--incidents"), env),
            "audit-json": (OK, ("audit", db, "--all", "--json"), env),
        },
    )
    assert_no_secret_in(run, SECRETS, every_file=True)


def test_engines_and_the_agent(fleet: Fleet, tmp_path: Path) -> None:
    """engine, agent and check-engine: tokens from files and the environment; an engine that
    answers 401 to the token a command holds."""
    run = fleet.run
    host = tmp_path / "host"
    host.mkdir()
    beside = ("--engine", f"sglang:{fleet.engine_url}", "--artifacts", str(host))
    agent = ("agent", *beside, "--port", "0")
    _runs(
        run,
        {
            "engine-empty": (
                USAGE,
                ("engine", "--port", "0", "--token-file", fleet.key("empty")),
                NO_ENV,
            ),
            "agent-no-token": (
                Exit.UNSAFE,
                (*agent, "--json"),
                {"LORALEDGER_ENGINE_TOKEN": ENGINE_TOKEN},
            ),
            "check-engine-401-file": (
                FAILED,
                ("check-engine", fleet.engine_url, "--api-key-file", fleet.key("wrong")),
                NO_ENV,
            ),
        },
    )
    with listening(
        run,
        "agent",
        "-v",
        *agent,
        "--token-file",
        fleet.key("agent"),
        "--json",
        LORALEDGER_ENGINE_TOKEN=ENGINE_TOKEN,
    ):
        pass
    with listening(
        run,
        "agent-wrong-engine-token",
        "-vv",
        *agent,
        "--json",
        LORALEDGER_AGENT_TOKEN=AGENT_TOKEN,
        LORALEDGER_ENGINE_TOKEN=WRONG_TOKEN,
    ) as (_, row):
        assert isinstance(row, dict)
        # a step the agent forwards: the engine refuses the wrong engine token the agent holds
        refused = httpx.post(
            f"{row['url']}/loraledger/unload",
            json={"lora_name": "policy@default-9-0123456789abcdef", "attempt": 1},
            headers={"authorization": f"Bearer {AGENT_TOKEN}"},
            timeout=60,
            trust_env=False,
        )
        assert refused.status_code >= 400, refused.text
        (run / "agent-refused.json").write_bytes(refused.content)
    # serve holding a wrong engine token: the engine answers 401 to its control calls
    # (the stray it sees under its prefix is unloaded, refused), each one logged
    with listening(
        run,
        "serve-wrong-engine-token",
        "-v",
        "serve",
        "--db",
        str(tmp_path / "other.db"),
        "--port",
        "0",
        "--engine",
        f"e0=local:{fleet.engine_url}",
        "--engine-token-file",
        fleet.key("wrong"),
        "--json",
    ):
        logged = run / "serve-wrong-engine-token.err"
        anyio.run(
            functools.partial(
                wait_for,
                "serve to log the engine's 401",
                lambda: "401" in logged.read_text(),
                timeout=120,
                every=0.1,
            )
        )
    assert_no_secret_in(run, SECRETS, every_file=True)


LOCKED_ROLE = "locked"


def _lock_a_role(server: PostgresServer) -> None:
    """Make role ``locked`` need its password (scram) on loopback, every other role trusted
    as before: the throwaway server's ``pg_hba.conf`` rewritten by the server itself (it owns
    its data directory) and reloaded."""

    async def lock() -> None:
        import asyncpg

        conn = await asyncpg.connect(server.url())
        try:
            await conn.execute(f"CREATE ROLE {LOCKED_ROLE} LOGIN PASSWORD 'the-right-one'")
            rules = [
                "local all all trust",
                f"host all {LOCKED_ROLE} 127.0.0.1/32 scram-sha-256",
                f"host all {LOCKED_ROLE} ::1/128 scram-sha-256",
                "host all all 127.0.0.1/32 trust",
                "host all all ::1/128 trust",
            ]
            values = ", ".join(f"('{rule}')" for rule in rules)
            await conn.execute(
                f"COPY (SELECT * FROM (VALUES {values}) AS hba) TO "
                f"'{server.data_dir / 'pg_hba.conf'}'"
            )
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()

    run_blocking(lock)


def test_a_postgres_log_with_passwords(postgres_server: PostgresServer, tmp_path: Path) -> None:
    """serve, verify, replay and audit on a PostgreSQL log whose URL holds a password in its
    user part and one (percent-encoded) in its query string; a password the server refuses; a
    URL that does not parse; a scheme that is not a store's."""
    database = run_blocking(create_database, postgres_server, "secrets_log")
    base = database.rsplit("/", 1)[0].partition("@")[2]  # host:port
    url = (
        f"postgresql://postgres:{quote(PG_USER_PASSWORD, safe='')}@{base}/secrets_log"
        f"?password={quote(PG_QUERY_PASSWORD, safe='')}&sslmode=disable"
    )
    with listening(tmp_path, "serve-pg", "-v", "serve", "--db", url, "--port", "0", "--json") as (
        _,
        row,
    ):
        assert isinstance(row, dict)
    _runs(
        tmp_path,
        {
            "verify-pg": (OK, ("verify", url, "--json"), NO_ENV),
            "replay-pg": (OK, ("replay", url, "--incidents"), NO_ENV),
            "replay-pg-json": (OK, ("replay", url, "--json"), NO_ENV),
            # no session in this log yet: an error that names the log
            "audit-pg": (FAILED, ("audit", url, "--all", "--json"), NO_ENV),
        },
    )
    _lock_a_role(postgres_server)
    wrong = quote(PG_WRONG_PASSWORD, safe="")
    refused = f"postgresql://{LOCKED_ROLE}:{wrong}@{base}/secrets_log"
    refused_by_query = f"postgresql://{LOCKED_ROLE}@{base}/secrets_log?password={wrong}"
    unparsable = f"postgresql://postgres:{PG_USER_PASSWORD}@[::1/db?password={PG_QUERY_PASSWORD}"
    mysql = f"mysql://root:{PG_USER_PASSWORD}@{base}/db"
    serve = ("-v", "serve", "--port", "0", "--db")
    _runs(
        tmp_path,
        {
            "verify-refused": (FAILED, ("verify", refused, "--json"), NO_ENV),
            "verify-refused-query": (FAILED, ("verify", refused_by_query), NO_ENV),
            "serve-refused": (FAILED, (*serve, refused), NO_ENV),
            "serve-refused-query": (FAILED, (*serve, refused_by_query, "--json"), NO_ENV),
            "replay-refused": (FAILED, ("replay", refused), NO_ENV),
            "audit-refused": (FAILED, ("audit", refused_by_query, "--all", "--json"), NO_ENV),
            "verify-unparsable": (FAILED, ("verify", unparsable), NO_ENV),
            "serve-unparsable": (FAILED, (*serve, unparsable), NO_ENV),
            "verify-mysql": (FAILED, ("verify", mysql, "--json"), NO_ENV),
            "serve-mysql": (FAILED, (*serve, mysql), NO_ENV),
            "serve-argv-token": (FAILED, (*serve, mysql, "--token", LEDGER_TOKEN), NO_ENV),
        },
    )
    said = (tmp_path / "verify-refused.out").read_text() + (
        tmp_path / "verify-refused.err"
    ).read_text()
    assert "password authentication failed" in said, said
    assert_no_secret_in(tmp_path, SECRETS, every_file=True)
