"""The local engine over HTTP with the staged transport: :class:`LocalHTTPEngine`.

The same adapter as :class:`engines.sglang.SGLangEngine` (generation, incarnation and the
ordinary SGLang endpoints are shared), but publication goes through loraledger's staged
endpoints (:mod:`engines.local.wire`): ``prepare`` fences the attempt *on the engine*, buckets
stream as msgpack and are verified tensor by tensor on arrival, ``load`` recomputes the digest
on the engine, ``unload`` carries the attempt (the engine refuses a stale cleanup), and the
inventory carries digests. Every refusal comes back as a 400 with a machine code; any other
answer is ambiguous.

It imports no torch: a control plane can drive a local engine process without the model stack.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any

import httpx
import msgspec

from engines.contract import (
    Bucket,
    Candidate,
    CleanRefusal,
    ErrorCode,
    Inventory,
    Receipt,
    Transport,
    UnloadReceipt,
    check_name,
)
from engines.local import wire
from engines.sglang import SGLangEngine

_receipt = msgspec.json.Decoder(Receipt)
_unload = msgspec.json.Decoder(UnloadReceipt)
_inventory = msgspec.json.Decoder(Inventory)
_ack = msgspec.json.Decoder(wire.BucketAck)
_error = msgspec.json.Decoder(wire.ErrorBody)
_encode = msgspec.json.Encoder()


class LocalHTTPEngine(SGLangEngine):
    """A local engine process (``python -m engines.local.server``) as a staged fleet member."""

    kind = "local"
    transport: Transport = "staged"

    async def _staged(
        self,
        what: str,
        path: str,
        decoder: msgspec.json.Decoder[Any],
        *,
        timeout: float,
        body: Any = None,
        content: bytes | None = None,
        method: str = "POST",
    ) -> Any:
        headers = None
        if body is not None:
            content, headers = _encode.encode(body), {"content-type": "application/json"}
        elif content is not None:
            headers = {"content-type": wire.MSGPACK}
        response = await self._send(
            method, f"{wire.PREFIX}{path}", timeout=timeout, content=content, headers=headers
        )
        if response.status_code == 200:
            try:
                return decoder.decode(response.content)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise self._ambiguous(
                    ErrorCode.MALFORMED_REPLY, f"{what}: unreadable reply: {exc}"
                ) from exc
        self._raise_refusal(what, response)

    def _raise_refusal(self, what: str, response: httpx.Response) -> None:
        if response.status_code == 400:
            try:
                detail = _error.decode(response.content).error
            except (msgspec.DecodeError, msgspec.ValidationError):
                detail = None
            if detail is not None and detail.code in wire.CLEAN_CODES:
                raise self._clean(detail.code, detail.message, status=400)
        raise self._unrecognised(what, response)

    async def prepare(self, candidate: Candidate) -> Receipt:
        receipt: Receipt = await self._staged(
            f"prepare {candidate.lora_name}",
            "/prepare",
            _receipt,
            timeout=self.timeouts.control,
            body=candidate,
        )
        return self._ours(receipt)

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        async for bucket in buckets:
            upload = wire.BucketUpload(
                lora_name=candidate.lora_name,
                attempt=candidate.attempt,
                digest=candidate.digest,
                bucket=bucket,
            )
            ack: wire.BucketAck = await self._staged(
                f"bucket {bucket.index} of {candidate.lora_name}",
                "/bucket",
                _ack,
                timeout=self.timeouts.control,
                content=wire.bucket_encoder.encode(upload),
            )
            if ack.index != bucket.index:
                raise self._ambiguous(
                    ErrorCode.MALFORMED_REPLY, f"bucket {bucket.index} acknowledged as {ack.index}"
                )

    async def load(self, candidate: Candidate) -> Receipt:
        receipt: Receipt = await self._staged(
            f"load {candidate.lora_name}",
            "/load",
            _receipt,
            timeout=self.timeouts.control,
            body=candidate,
        )
        return self._ours(receipt)

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        """The engine fences the attempt and answers once the adapter is physically freed
        (after its in-flight requests drained), hence the long timeout."""
        try:
            check_name(lora_name)
        except CleanRefusal as exc:
            exc.engine_id = self.engine_id
            raise
        receipt: UnloadReceipt = await self._staged(
            f"unload {lora_name}",
            "/unload",
            _unload,
            timeout=self.timeouts.unload,
            body=wire.UnloadRequest(lora_name=lora_name, attempt=attempt),
        )
        return msgspec.structs.replace(receipt, engine_id=self.engine_id)

    async def inventory(self) -> Inventory:
        inventory: Inventory = await self._staged(
            "inventory", "/inventory", _inventory, timeout=self.timeouts.control, method="GET"
        )
        self._last_incarnation = inventory.incarnation
        return msgspec.structs.replace(inventory, engine_id=self.engine_id)

    async def incarnation(self) -> str:
        """The engine's own incarnation id (``/server_info``'s ``incarnation``), the same value
        its receipts and inventories carry."""
        info = await self.server_info()
        self._incarnation_of(info)  # refreshes the stamp used by generate()
        value = info.get("incarnation")
        if not isinstance(value, str) or not value:
            raise self._ambiguous(ErrorCode.MALFORMED_REPLY, "/server_info has no incarnation")
        self._last_incarnation = value
        return value

    def _ours(self, receipt: Receipt) -> Receipt:
        return msgspec.structs.replace(receipt, engine_id=self.engine_id)
