"""An engine request the HTTP client refuses (an illegal header value) becomes an error whose
text does not quote the header: the refusal's own message does (``Illegal header value
b'Bearer …'``), and the reconciler logs an engine error on every probe.

Before: the error was ``CONNECTION_LOST: GET /server_info: LocalProtocolError("Illegal header
value b'Bearer <the engine token>…'")``, logged by ``serve`` once a second. A token read from
a file can no longer be illegal (tests/security/test_token_files.py); this holds for a token
given through the Python API too."""

from __future__ import annotations

import socket

import httpx
import pytest

from engines.http import engine_client, transport_failure

pytestmark = pytest.mark.anyio

TOKEN = "engine-s3cret-in-a-header"


async def test_a_refused_header_is_not_quoted_in_the_engine_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:  # accepts; never answers
        port = listener.getsockname()[1]
        headers = {"authorization": f"Bearer {TOKEN}\n# old {TOKEN}-0"}
        async with engine_client(f"http://127.0.0.1:{port}", headers=headers) as client:
            with pytest.raises(httpx.LocalProtocolError) as refused:
                await client.get("/server_info")
    assert TOKEN in str(refused.value)  # what the client says, and must not reach a log
    error = transport_failure(refused.value, "GET /server_info", engine_id="e0")
    assert TOKEN not in str(error) and TOKEN not in repr(error)
    assert "refused the request" in str(error)
