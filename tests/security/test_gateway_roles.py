"""A ``loraledger gateway`` process under least privilege: it presents a ``gateway`` token to
``serve`` (register, bind, renew, trouble, provenance, deregister: everything it sends is
admitted), and its own ``--tokens`` give its clients roles: a rollout token generates through
it, a trainer token is refused 403 in OpenAI's shape, and the gateway's token cannot publish
at ``serve``."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import openai
import pytest

from tests.security.runs import assert_no_secret_in, listening
from tests.support.provenance import stored_rows
from tests.tools.test_serve import _adapter_dir

pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

OPERATOR = "op-t0ken-gw"
TRAINER = "tr-t0ken-gw"
ROLLOUT = "ro-t0ken-gw"
GATEWAY = "gw-t0ken-gw"
ENGINE = "engine-t0ken-gw"


def test_a_gateway_process_works_with_the_gateway_role_and_gives_its_clients_roles(
    tmp_path: Path,
) -> None:
    serve_tokens = tmp_path / "serve.tokens"
    serve_tokens.write_text(f"trainer {TRAINER}\ngateway {GATEWAY}\n")
    gateway_tokens = tmp_path / "gateway.tokens"
    gateway_tokens.write_text(f"rollout {ROLLOUT}\ntrainer {TRAINER}\n")
    db = tmp_path / "ledger.db"
    with listening(
        tmp_path, "serve", "serve", "--db", str(db), "--port", "0", "--engine", "e0=local:",
        "--tokens", str(serve_tokens), "--json",
        LORALEDGER_TOKEN=OPERATOR, LORALEDGER_ENGINE_TOKEN=ENGINE,
    ) as (_, serve_row):  # fmt: skip
        assert isinstance(serve_row, dict)
        ledger = str(serve_row["url"])
        with httpx.Client(base_url=ledger, trust_env=False, timeout=120) as http:
            published = http.post(
                "/versions",
                json={"version_id": 1, "adapter_dir": str(_adapter_dir(tmp_path, 1))},
                headers={"authorization": f"Bearer {TRAINER}"},
            )
            assert published.status_code == 200, published.text
            with listening(
                tmp_path, "gateway", "gateway", "--ledger", ledger, "--port", "0",
                "--owner", "gw-1", "--tokens", str(gateway_tokens), "--json",
                LORALEDGER_TOKEN=GATEWAY, LORALEDGER_ENGINE_TOKEN=ENGINE,
            ) as (gateway, gateway_row):  # fmt: skip
                assert isinstance(gateway_row, dict)
                face = str(gateway_row["url"]) + "/v1"
                with openai.OpenAI(base_url=face, api_key=ROLLOUT, max_retries=0) as client:
                    raw = client.chat.completions.with_raw_response.create(
                        model="policy",
                        messages=[{"role": "user", "content": "hello"}],
                        max_tokens=2,
                        extra_headers={"x-session-id": "through-the-gateway"},
                    )
                    assert raw.headers["x-loraledger-version"] == "1"
                with openai.OpenAI(base_url=face, api_key=TRAINER, max_retries=0) as trainer:
                    with pytest.raises(openai.PermissionDeniedError) as refused:
                        trainer.models.list()
                    assert refused.value.code == "FORBIDDEN", refused.value
                publish = http.post(
                    "/versions",
                    json={"version_id": 2, "adapter_dir": str(_adapter_dir(tmp_path, 2))},
                    headers={"authorization": f"Bearer {GATEWAY}"},
                )
                assert publish.status_code == 403, publish.text
            assert gateway.returncode == 0, (tmp_path / "gateway.err").read_text()
        rows = anyio.run(stored_rows, db)  # the gateway's row reached serve's store
        assert [(r.engine, r.version_id) for r in rows] == [("e0", 1)]
    assert_no_secret_in(tmp_path, [OPERATOR, TRAINER, ROLLOUT, GATEWAY, ENGINE])
