"""``loraledger publish``: an adapter directory published through a running ``serve`` on
another host (the work: ``tools/publish.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tools.cli.common import DEFAULT_URL, JsonOpt, guarded, secret
from tools.output import emit, to_json


@guarded
def publish(
    adapter_dir: Annotated[
        Path, typer.Argument(help="A PEFT LoRA directory (adapter_config.json + safetensors).")
    ],
    version: Annotated[int, typer.Option("--version", help="The version id (the step).")],
    url: Annotated[
        str,
        typer.Option("--url", envvar="LORALEDGER_URL", help="Where `loraledger serve` listens."),
    ] = DEFAULT_URL,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="File whose first line is serve's bearer token; default: $LORALEDGER_TOKEN.",
        ),
    ] = None,
    allow_rollback: Annotated[
        bool,
        typer.Option(
            "--allow-rollback", help="Publish a version lower than the default, on purpose."
        ),
    ] = False,
    retry_for: Annotated[
        float,
        typer.Option(
            "--retry-for", help="Seconds to keep retrying a service that does not answer."
        ),
    ] = 60.0,
    json: JsonOpt = False,
) -> None:
    """Upload a PEFT adapter directory to a running `loraledger serve` and publish it as
    --version: no filesystem shared with the service (the bytes are streamed, checked against
    their digest, resumed after a lost connection)."""
    from tools.arguments import seconds, service_url
    from tools.progress import progress_bar
    from tools.publish import publish_dir

    with progress_bar("uploading", json=json, unit="bytes") as update:
        outcome = publish_dir(
            service_url("--url", url),
            adapter_dir,
            version,
            token=secret(None, "", token_file, "LORALEDGER_TOKEN"),
            allow_rollback=allow_rollback,
            retry_for_s=seconds("--retry-for", retry_for),
            progress=update,
        )
    if json:
        emit(to_json(outcome, row="publication"))
        return
    where = f" as {outcome.lora_name}" if outcome.lora_name else ""
    revision = f", revision {outcome.revision}" if outcome.revision is not None else ""
    why = f" ({outcome.code}: {outcome.message})" if outcome.code else ""
    print(f"version {outcome.version_id}: {outcome.status}{where}{revision}{why}")
