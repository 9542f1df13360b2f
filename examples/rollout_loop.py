"""An asyncio rollout loop on the official OpenAI client: multi-turn episodes, streamed, each
named by the ``x-session-id`` header, reading which version served each turn and how stale it
was (``x-loraledger-version``, ``x-loraledger-staleness``), while a trainer publishes a new
version in the middle of the run.

What it shows: an episode that started on version 1 keeps version 1 for every later turn, even
after version 2 is published (its staleness grows to 1 instead); an episode that starts after
the publication is served by version 2. Each episode is released when it ends, so the ledger
may reclaim version 1 once its last episode is over.

    python examples/rollout_loop.py [--workdir DIR]

It starts its own ``loraledger serve`` over a local CPU engine (``local_service.py``) and
stops it at the end; against your own service, keep the ``episode`` function and point
``AsyncOpenAI`` at it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import anyio
import httpx
import openai
from local_service import Service, local_service, random_adapter

from publisher.remote import HttpTrainerClient

TURNS = 3


async def episode(
    client: openai.AsyncOpenAI, service: Service, name: str, started: anyio.Event | None = None
) -> None:
    """One multi-turn episode: every turn streamed on the session's version."""
    messages: list[dict[str, str]] = [{"role": "user", "content": "the quick brown fox"}]
    for turn in range(1, TURNS + 1):
        raw = await client.chat.completions.with_raw_response.create(
            model="policy",  # the alias: "my session's version"
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            stream=True,
            extra_headers={"x-session-id": name},
        )
        version = raw.headers["x-loraledger-version"]  # sent before the first token
        staleness = raw.headers["x-loraledger-staleness"]
        text = ""
        stream = raw.parse()
        assert isinstance(stream, openai.AsyncStream)  # stream=True
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        print(f"{name} turn {turn}: version {version} staleness {staleness} {text!r}")
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
        if started is not None:
            started.set()  # the first turn is bound: the trainer may publish now
            started = None
        await anyio.sleep(0.2)  # the environment's turn
    async with httpx.AsyncClient(base_url=service.url, trust_env=False) as http:
        released = await http.post(
            f"/v1/sessions/{name}/release",
            headers={"authorization": f"Bearer {service.token}"},
        )
        released.raise_for_status()


async def main(workdir: Path) -> None:
    with local_service(workdir / "serve") as service:
        async with HttpTrainerClient(service.url, token=service.token) as trainer:
            first = await trainer.publish(random_adapter(workdir, 1), step=1)
            print(f"published version {first.version_id}: {first.status}")
            client = openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key=service.token)
            async with client:
                bound = [anyio.Event() for _ in range(2)]
                async with anyio.create_task_group() as tg:
                    for i, event in enumerate(bound):
                        tg.start_soon(episode, client, service, f"episode-{i}", event)
                    for event in bound:
                        await event.wait()
                    second = await trainer.publish(random_adapter(workdir, 2), step=2)
                    print(f"published version {second.version_id}: {second.status}")
                    tg.start_soon(episode, client, service, "episode-late")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workdir", type=Path, help="where the service's log goes (default: a temp dir)"
    )
    args = parser.parse_args()
    if args.workdir is not None:
        anyio.run(main, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="loraledger-rollouts-") as tmp:
            anyio.run(main, Path(tmp))
