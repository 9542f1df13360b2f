"""The staged-transfer HTTP protocol of the local engine (loraledger's extension endpoints).

Shared by the server (:mod:`engines.local.server`) and the client
(:class:`engines.local.client.LocalHTTPEngine`), so the two cannot drift. It imports neither
torch nor the engine: a control plane can speak it without the model stack.

==================================  =====================================  ======================
endpoint                            request body                           200 reply
==================================  =====================================  ======================
``POST /loraledger/prepare``        :class:`~engines.contract.Candidate`   ``Receipt`` (prepared)
                                    (JSON)
``POST /loraledger/bucket``         :class:`BucketUpload` (msgpack,        :class:`BucketAck`
                                    ``application/msgpack``)
``POST /loraledger/load``           ``Candidate`` (JSON)                   ``Receipt`` (ready)
``POST /loraledger/unload``         :class:`UnloadRequest` (JSON)          ``UnloadReceipt``
``GET /loraledger/inventory``       --                                     ``Inventory`` (digests,
                                                                           staged names)
==================================  =====================================  ======================

A clean refusal is HTTP 400 with :class:`ErrorBody` (``{"error": {"code", "message"}}``); the
code is one of :class:`~engines.contract.ErrorCode`'s clean codes (``ATTEMPT_REQUIRED``: an
unload of a managed name without its attempt). An engine that is stopping answers 503; a
missing or wrong token 401 and a body over its cap 413 (``{"error": {"code", "message"}}``
too, read as ambiguous by the client: nothing proves what the engine holds). Buckets are
binary (msgpack): base64 in JSON would inflate a 64 MiB bucket by a third and cost a decode pass.
"""

from __future__ import annotations

import msgspec

from engines.contract import Bucket, ErrorCode

PREFIX = "/loraledger"
MSGPACK = "application/msgpack"

CLEAN_CODES = frozenset(
    {
        ErrorCode.INVALID_NAME,
        ErrorCode.INVALID_ADAPTER,
        ErrorCode.DIGEST_MISMATCH,
        ErrorCode.RANK_UNSUPPORTED,
        ErrorCode.ALREADY_LOADED,
        ErrorCode.NOT_LOADED,
        ErrorCode.NAME_PROTECTED,
        ErrorCode.NAME_RECLAIMED,
        ErrorCode.STALE_ATTEMPT,
        ErrorCode.ATTEMPT_REQUIRED,
        ErrorCode.NOT_PREPARED,
        ErrorCode.STAGING_FULL,  # the engine-host agent's staging cap
        ErrorCode.PATH_OUTSIDE_STORE,
        ErrorCode.BAD_REQUEST,
    }
)


class BucketUpload(msgspec.Struct, frozen=True, kw_only=True):
    """One bucket of one attempt; (name, attempt, digest) select the staging area."""

    lora_name: str
    attempt: int
    digest: str
    bucket: Bucket


class BucketAck(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    received_tensors: int  # tensors staged so far for this attempt


class UnloadRequest(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    attempt: int | None = None


class ErrorDetail(msgspec.Struct, frozen=True):
    code: str
    message: str


class ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorDetail


bucket_encoder = msgspec.msgpack.Encoder()
bucket_decoder = msgspec.msgpack.Decoder(BucketUpload)
