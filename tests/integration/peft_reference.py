"""The reference the vLLM integration tests compare against: the same tiny model and adapter
directory run with transformers (+ peft) in this process. Expected tokens are never written
down; they are computed here."""

from __future__ import annotations

from pathlib import Path


class PeftReference:
    """Greedy decoding with transformers (+ peft) in float32, no EOS stop (= ``ignore_eos``)."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        torch.set_num_threads(1)  # leave the other core to the server under test
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._models: dict[str | None, object] = {}

    def _model(self, adapter_dir: Path | None):  # type: ignore[no-untyped-def]
        key = None if adapter_dir is None else str(adapter_dir)
        if key not in self._models:
            import torch
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            if adapter_dir is not None:
                model = PeftModel.from_pretrained(model, str(adapter_dir))
            self._models[key] = model.eval()
        return self._models[key]

    def prompt_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def greedy(self, prompt: str, n: int, adapter_dir: Path | None = None) -> tuple[int, ...]:
        import torch

        model = self._model(adapter_dir)
        ids = torch.tensor([self.prompt_ids(prompt)])
        out: list[int] = []
        past = None
        with torch.no_grad():
            step = ids
            for _ in range(n):
                result = model(input_ids=step, past_key_values=past, use_cache=True)
                past = result.past_key_values
                nxt = int(torch.argmax(result.logits[0, -1]))
                out.append(nxt)
                step = torch.tensor([[nxt]])
        return tuple(out)
