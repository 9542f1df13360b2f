"""A rollout token generates, and nothing else of the control plane: against a real
``loraledger serve`` process (``--engine e0=local:``, ``--tokens``), every control call it
tries is refused 403 with the log unchanged, and its session's next turn is still served on
its version; a trainer token publishes and cannot suspend an engine.

Before: one token did everything. The OpenAI api_key a rollout holds (beside model-written
code) published versions, suspended and removed engines, forgot tombstones (a closed session
id could bind again) and sent provenance rows and trouble reports in a gateway's name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.security.runs import assert_no_secret_in, listening
from tests.tools.test_serve import _adapter_dir

pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

OPERATOR = "op-t0ken-least"
TRAINER = "tr-t0ken-least"
ROLLOUT = "ro-t0ken-least"


def _turn(client: openai.OpenAI) -> tuple[str, str]:
    raw = client.chat.completions.with_raw_response.create(
        model="policy",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        extra_body={"ignore_eos": True},  # sampled, the tiny model may end first: "stop"
        extra_headers={"x-session-id": "rollout-1"},
    )
    assert raw.parse().choices[0].finish_reason == "length"
    return raw.headers["x-loraledger-engine"], raw.headers["x-loraledger-version"]


def test_a_rollout_token_generates_and_every_control_call_it_tries_is_refused(
    tmp_path: Path,
) -> None:
    adapters = [_adapter_dir(tmp_path, seed) for seed in (1, 2)]
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# who may do what\ntrainer {TRAINER}\nrollout {ROLLOUT} workers\n")
    with listening(
        tmp_path, "serve", "serve", "--db", str(tmp_path / "ledger.db"), "--port", "0",
        "--engine", "e0=local:", "--tokens", str(tokens), "--json",
        LORALEDGER_TOKEN=OPERATOR,
    ) as (_, row):  # fmt: skip
        assert isinstance(row, dict)
        url = str(row["url"])
        with (
            httpx.Client(base_url=url, trust_env=False, timeout=120) as http,
            openai.OpenAI(base_url=url + "/v1", api_key=ROLLOUT, max_retries=0) as client,
        ):

            def call(token: str, path: str, body: dict[str, Any]) -> httpx.Response:
                return http.post(path, json=body, headers={"authorization": f"Bearer {token}"})

            def seq() -> int:
                last: int = http.get("/health").json()["seq"]
                return last

            published = call(
                TRAINER, "/versions", {"version_id": 1, "adapter_dir": str(adapters[0])}
            )
            assert published.status_code == 200, published.text
            before = seq()
            suspend = call(TRAINER, "/engines/e0/suspend", {"detail": "a trainer tries"})
            assert suspend.status_code == 403, suspend.text
            assert suspend.json()["details"] == {"needed": ["operator"], "role": "trainer"}
            assert seq() == before

            assert _turn(client) == ("e0", "1")
            attempts: dict[str, dict[str, Any]] = {
                "/versions": {"version_id": 2, "adapter_dir": str(adapters[1])},
                "/engines/e0/suspend": {"detail": "a rollout tries"},
                "/engines/e0/resume": {},
                "/engines/e0/remove": {},
                "/sessions/forget": {"sessions": ["rollout-1"]},
                "/provenance": {"rows": []},
                "/engines/e0/trouble": {"code": "X", "clean": False, "message": "made up"},
            }
            before = seq()
            for path, body in attempts.items():
                refused = call(ROLLOUT, path, body)
                assert refused.status_code == 403, (path, refused.text)
                error = refused.json()
                assert error["code"] == "FORBIDDEN" and error["details"]["role"] == "rollout"
                assert "operator" in error["details"]["needed"], error
            assert seq() == before
            status = http.get("/status").json()
            assert [e["engine"] for e in status["engines"]] == ["e0"]
            assert [e["routable"] for e in status["engines"]] == [True], status["engines"]
            assert status["default"] == 1, status
            assert _turn(client) == ("e0", "1")
    assert_no_secret_in(tmp_path, [OPERATOR, TRAINER, ROLLOUT])
