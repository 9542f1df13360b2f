"""How the OpenAI gateway reads an engine's 4xx to a forwarded generation
(:func:`engines.openai_http.refusal_of`): by the rule of that engine's own adapter, so the
OpenAI face and the Python gateway agree on what ``NOT_LOADED`` (another holder may serve it)
is. Reply bodies as the real servers write them (docs/engines.md): vLLM's error envelope with
its numeric ``code``, SGLang's OpenAI error object, the local engine's coded error."""

from __future__ import annotations

from typing import Any

import pytest

from engines.contract import ErrorCode
from engines.openai_http import refusal_of

NAME = "agent@dep-1-d707f524fc828ef5"


def vllm(status: int, err_type: str, message: str, param: str | None = None) -> Any:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


@pytest.mark.parametrize(
    ("kind", "status", "reply", "code"),
    [
        # vLLM: an unknown model is refused before scheduling anything
        (
            "vllm",
            404,
            vllm(404, "NotFoundError", f"The model `{NAME}` does not exist."),
            ErrorCode.NOT_LOADED,
        ),
        # ... but a 404 about another name proves nothing about ours
        ("vllm", 404, vllm(404, "NotFoundError", "The model `other` does not exist."), "404"),
        ("vllm", 400, vllm(400, "BadRequestError", "bad", "temperature"), ErrorCode.BAD_REQUEST),
        # SGLang's OpenAI routes: the error object itself, its code the HTTP status
        (
            "sglang",
            400,
            {
                "object": "error",
                "message": f"The following requested LoRA adapters are not loaded: {NAME}",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            ErrorCode.NOT_LOADED,
        ),
        # the local engine: SGLang's terms with loraledger's codes
        (
            "local",
            400,
            {"error": {"message": "reclaimed", "type": "x", "code": "NAME_RECLAIMED"}},
            ErrorCode.NAME_RECLAIMED,
        ),
        (
            "local",
            400,
            {"error": {"message": "not loaded", "code": "NOT_LOADED"}},
            ErrorCode.NOT_LOADED,
        ),
        # unrecognised: the code the engine gave is kept (vLLM's: the HTTP status)
        ("local", 400, {"error": {"message": "n too big", "code": "TOO_MANY"}}, "TOO_MANY"),
        ("vllm", 422, vllm(422, "UnprocessableEntity", "bad body"), "422"),
        ("local", 400, {"error": {"message": "no code"}}, ""),
        ("sglang", 400, None, ""),  # not JSON
    ],
)
def test_a_refusal_is_read_by_the_engines_own_rule(
    kind: str, status: int, reply: Any, code: str
) -> None:
    refusal = refusal_of(status, reply, kind=kind, lora_name=NAME, engine_id="e0")
    assert refusal.clean
    assert (refusal.code, refusal.status, refusal.engine_id) == (code, status, "e0")
    assert refusal.message
