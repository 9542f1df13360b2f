"""A tiny on-policy RL loop on CPU, end to end: a LoRA policy on the tiny model, rollouts
through the OpenAI face of ``loraledger serve``, a toy reward, a REINFORCE update weighted by
the staleness each sample was generated at, a new version published every few updates while
the next rollouts run, and ``loraledger audit`` at the end showing every episode on one
version.

    python examples/rl_loop.py [--workdir DIR] [--updates 4]

The pieces, in the order a step runs them:

* **rollouts**: ``EPISODES`` two-turn episodes at once, each a session (``x-session-id``) on the
  official ``openai.AsyncOpenAI`` client; each turn's reply says which version served it and how
  many versions behind the newest it was (``x-loraledger-version``, ``x-loraledger-staleness``).
  An episode is released when it ends, so the ledger reclaims a version once its last episode
  is over;
* **reward**: the share of a completion's characters that are letters or spaces (the untrained
  tiny model emits mostly byte noise);
* **update**: REINFORCE with the batch mean as baseline; a sample generated ``s`` versions
  behind counts ``STALE_DISCOUNT ** s`` (off-policy samples count less);
* **publication**: every ``PUBLISH_EVERY`` updates the adapter is saved and published with
  ``HttpTrainerClient``, as version = the update count, *while the next rollouts run* (an
  episode bound before it commits keeps its version and reports staleness 1 on later turns).
  Version 1 is the untrained policy (version ids start at 1).

It starts its own ``loraledger serve`` over a local CPU engine (``local_service.py``), stops
it, then audits its log.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import torch
from local_service import Service, local_service
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from engines import ensure_tiny_model
from publisher import PublicationError
from publisher.remote import HttpTrainerClient

EPISODES = 4
TURNS = 2
MAX_TOKENS = 6
PUBLISH_EVERY = 2
STALE_DISCOUNT = 0.5
PROMPTS = ["the quick brown fox", "hello world", "adapters change", "a session keeps"]


@dataclass(frozen=True)
class Sample:
    """One turn of an episode: what was asked, what the policy said, and on what version."""

    episode: str
    turn: int
    prompt: str
    completion: str
    version: int
    staleness: int
    reward: float = 0.0


def reward(text: str) -> float:
    return sum(c.isalpha() or c == " " for c in text) / max(len(text), 1)


async def run_episode(
    client: openai.AsyncOpenAI, service: Service, name: str, prompt: str
) -> list[Sample]:
    turns: list[Sample] = []
    text = prompt
    for turn in range(1, TURNS + 1):
        raw = await client.completions.with_raw_response.create(
            model="policy", prompt=text, max_tokens=MAX_TOKENS, extra_headers={"x-session-id": name}
        )
        completion = raw.parse().choices[0].text
        turns.append(
            Sample(
                episode=name,
                turn=turn,
                prompt=text,
                completion=completion,
                version=int(raw.headers["x-loraledger-version"]),
                staleness=int(raw.headers["x-loraledger-staleness"]),
            )
        )
        text += completion
    async with httpx.AsyncClient(base_url=service.url, trust_env=False) as http:
        released = await http.post(
            f"/v1/sessions/{name}/release", headers={"authorization": f"Bearer {service.token}"}
        )
        released.raise_for_status()
    episode_reward = sum(reward(t.completion) for t in turns) / len(turns)
    return [Sample(**{**t.__dict__, "reward": episode_reward}) for t in turns]


async def rollouts(client: openai.AsyncOpenAI, service: Service, step: int) -> list[Sample]:
    results: list[list[Sample]] = []

    async def one(i: int) -> None:
        results.append(
            await run_episode(client, service, f"step{step}-ep{i}", PROMPTS[i % len(PROMPTS)])
        )

    async with anyio.create_task_group() as tg:
        for i in range(EPISODES):
            tg.start_soon(one, i)
    return [s for episode in results for s in episode]


class Policy:
    """The LoRA policy being trained, on the same tiny base model the engine serves."""

    def __init__(self) -> None:
        transformers_logging.disable_progress_bar()  # keep the printout to the samples
        base = ensure_tiny_model()
        torch.manual_seed(0)
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        self.model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=5e-3)

    def logprob(self, prompt: str, completion: str) -> torch.Tensor:
        """log p(completion | prompt), summed over the completion's tokens."""
        head = self.tokenizer(prompt)["input_ids"]
        tail = self.tokenizer(completion)["input_ids"]
        ids = torch.tensor([head + tail])
        logits = self.model(input_ids=ids).logits[0, len(head) - 1 : -1]
        picked = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(head) :, None])
        return picked.sum()

    def update(self, samples: list[Sample]) -> float:
        """One REINFORCE step: advantage = reward - batch mean, each sample weighted by its
        staleness discount."""
        usable = [s for s in samples if s.completion]
        baseline = sum(s.reward for s in usable) / max(len(usable), 1)
        weights = [STALE_DISCOUNT**s.staleness for s in usable]
        loss = torch.zeros(())
        for sample, weight in zip(usable, weights, strict=True):
            advantage = sample.reward - baseline
            loss = loss - weight * advantage * self.logprob(sample.prompt, sample.completion)
        loss = loss / max(sum(weights), 1e-9)
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        return float(loss.detach())


async def save(policy: Policy, workdir: Path, version: int) -> Path:
    """The adapter as it is now, on disk: saved before the next update changes the weights."""
    adapter = workdir / f"step-{version}"
    await anyio.to_thread.run_sync(policy.model.save_pretrained, str(adapter))
    return adapter


async def publish(trainer: HttpTrainerClient, adapter: Path, version: int) -> None:
    try:
        outcome = await trainer.publish(adapter, step=version)
    except PublicationError as exc:  # RETRYABLE: the next publication tries anew
        print(f"version {version} not published: {exc.kind} {exc.code}")
        return
    print(f"published version {version}: {outcome.status}")


async def train(service: Service, workdir: Path, updates: int) -> None:
    policy = Policy()
    async with HttpTrainerClient(service.url, token=service.token) as trainer:
        await publish(trainer, await save(policy, workdir, 1), 1)
        client = openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key=service.token)
        async with client, anyio.create_task_group() as publications:
            published = anyio.Event()
            published.set()
            for step in range(1, updates + 1):
                samples = await rollouts(client, service, step)
                print(f"step {step}: episode    turn version staleness weight reward")
                for s in samples:
                    weight = STALE_DISCOUNT**s.staleness
                    print(
                        f"step {step}: {s.episode:<10} {s.turn:<4} v{s.version:<6} "
                        f"{s.staleness:<9} {weight:<6.2f} {s.reward:.2f}"
                    )
                loss = await anyio.to_thread.run_sync(policy.update, samples)
                print(f"step {step}: loss {loss:+.4f}")
                if step % PUBLISH_EVERY == 0 and step > 1:  # version 1: the untrained policy
                    await published.wait()  # one publication at a time
                    published = anyio.Event()
                    adapter = await save(policy, workdir, step)

                    async def publish_then_mark(
                        adapter: Path, version: int, done: anyio.Event
                    ) -> None:
                        await publish(trainer, adapter, version)
                        done.set()

                    # uploaded and published while the next rollouts run
                    publications.start_soon(publish_then_mark, adapter, step, published)
        status = await trainer.status()  # reclaim frees a version once its last episode ended
        print("versions: " + ", ".join(f"v{v.version_id} {v.state}" for v in status.versions))


def audit(db: Path) -> bool:
    """``loraledger audit`` over the stopped service's log: every episode's generations, each
    checked against its binding. True when each episode was served by one version only."""
    argv = [sys.executable, "-m", "tools.cli", "audit", str(db), "--all", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    single = True
    print("audit: episode    bound  versions served  turns  mismatches")
    for line in done.stdout.splitlines():
        row: dict[str, Any] = json.loads(line)
        if row.get("row") != "session":
            continue
        served = sorted({g["version_id"] for g in row["generations"]})
        one = served == [row["version_id"]] and not row["mismatches"]
        single = single and one
        print(
            f"audit: {row['session']:<10} v{row['version_id']:<5} {served!s:<16} "
            f"{len(row['generations']):<6} {len(row['mismatches'])}"
        )
    print(f"audit: every episode on one version: {'yes' if single else 'NO'}")
    return single


def main(workdir: Path, updates: int) -> int:
    with local_service(workdir / "serve") as service:
        anyio.run(train, service, workdir, updates)
    return 0 if audit(service.db) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workdir", type=Path, help="where the log and adapters go (default: a temp dir)"
    )
    parser.add_argument("--updates", type=int, default=4, help="policy updates to run")
    args = parser.parse_args()
    if args.workdir is not None:
        sys.exit(main(args.workdir, args.updates))
    with tempfile.TemporaryDirectory(prefix="loraledger-rl-") as tmp:
        sys.exit(main(Path(tmp), args.updates))
