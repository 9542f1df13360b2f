"""The chaos run's trainer, a process of its own so a fault can kill it mid-publication:
``python -m tests.chaos.trainer --serve URL --token-file FILE --dir DIR``.

It publishes a version every ``--every`` seconds through the HTTP trainer client (``step`` is
the version id; the adapters are made under ``DIR/adapters``) and records each publication as
the rollout clients record their operations (:class:`~tests.chaos.history.ClientOp`, one JSON
line each, in ``DIR/trainer-ops.jsonl``): a line before the call (outcome ``info``: not known
yet) and one after it with its outcome. A process killed mid-publication leaves only the first:
the publication is then unacknowledged, and the log may or may not hold it. A new life goes on
from the step after the last one any life began, so a restarted trainer never asks for a
version twice, acknowledged or not (as a trainer resuming from its last checkpoint).

It prints the ``listening`` row every cluster member prints once ready (without an address:
it serves nothing) and accepts the ``--port`` a member is started with.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import anyio
import msgspec

from publisher.drivers.publication import PublicationError, PublicationStatus
from publisher.remote.trainer import HttpTrainerClient
from tests.chaos.history import ClientOp, Outcome
from tools import logconfig
from tools.output import emit

OPS_FILE = "trainer-ops.jsonl"
PUBLISH_EVERY_S = 4.0
RETRY_FOR_S = 120.0
NOT_ANSWERED = "no answer: the trainer process ended"


def read_trainer_ops(path: Path) -> list[ClientOp]:
    """The publications of every life of the trainer, one per version: its last line (the
    outcome, or the ``info`` line written before the call when no answer came). A line cut
    by a SIGKILL mid-write is skipped."""
    decoder = msgspec.json.Decoder(ClientOp)
    by_version: dict[int | None, ClientOp] = {}
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                op = decoder.decode(line)
            except msgspec.DecodeError:
                continue
            by_version[op.version] = op
    return list(by_version.values())


def next_step(path: Path) -> int:
    """The step a new life of the trainer publishes first: the one after the last step any
    life began, answered or not (an unanswered one may be in the log: asking for it again
    would be a second publication of one step)."""
    begun = [op.version for op in read_trainer_ops(path) if op.version is not None]
    return max(begun, default=0) + 1


def _adapter(root: Path, version: int) -> Path:
    from tests.tools.test_serve import _adapter_dir

    out = root / f"adapter-{version}"
    return out if out.exists() else _adapter_dir(root, version)


class _Ops:
    """The ops file, appended one flushed line at a time (a SIGKILL keeps what was written)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("ab", buffering=0)
        self._encoder = msgspec.json.Encoder()

    def write(self, op: ClientOp) -> None:
        self._file.write(self._encoder.encode(op) + b"\n")


async def _publish(trainer: HttpTrainerClient, ops: _Ops, adapters: Path, version: int) -> None:
    invoked = time.time()
    pending = ClientOp(
        client="trainer",
        kind="publish",
        invoked=invoked,
        completed=invoked,
        outcome="info",
        code=NOT_ANSWERED,
        version=version,
    )
    ops.write(pending)
    outcome: Outcome = "info"
    code = ""
    try:
        answer = await trainer.publish(_adapter(adapters, version), step=version)
        ok = answer.status in (PublicationStatus.PUBLISHED, PublicationStatus.NO_OP)
        outcome, code = ("ok", "") if ok else ("fail", f"{answer.status} {answer.code}")
    except PublicationError as exc:
        outcome, code = "fail", str(exc.code)
    except Exception as exc:  # an unreachable serve past the retry window: not known
        code = type(exc).__name__
    ops.write(
        msgspec.structs.replace(
            pending,
            completed=time.time(),
            outcome=outcome,
            code=code,
        )
    )


async def train(url: str, token: str, root: Path, every_s: float) -> None:
    """Publish from the step after the last one begun, every ``every_s`` seconds, until
    killed."""
    path = root / OPS_FILE
    version = next_step(path)
    adapters = root / "adapters"
    adapters.mkdir(parents=True, exist_ok=True)
    ops = _Ops(path)
    emit({"row": "listening", "pid": os.getpid(), "url": ""})
    async with HttpTrainerClient(url, token=token, retry_for_s=RETRY_FOR_S) as trainer:
        while True:
            started = anyio.current_time()
            await _publish(trainer, ops, adapters, version)
            version += 1
            await anyio.sleep(max(0.0, every_s - (anyio.current_time() - started)))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.trainer")
    parser.add_argument("--serve", required=True, help="serve's URL (through its link)")
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True, help="the run's directory")
    parser.add_argument("--every", type=float, default=PUBLISH_EVERY_S)
    parser.add_argument("--port", type=int, default=0, help="ignored: it listens on none")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logconfig.configure(0)  # warnings on stderr; stdout holds the one row
    token = args.token_file.read_text().split()[0]
    anyio.run(lambda: train(args.serve, token, args.dir, args.every))


if __name__ == "__main__":
    main()
