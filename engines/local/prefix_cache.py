"""Prefix cache: reuse the KV state of a prompt prefix, never across adapter incarnations.

The key is ``(adapter_key, namespace, tokens)``. ``adapter_key`` is the engine-local id minted
fresh for every load (like SGLang's uuid ``lora_id``), never the adapter *name*: vLLM keyed its
cache by name and served KV computed with old weights after a same-name reload (vLLM issues
#30931, #42125). ``namespace`` carries the request's ``cache_salt``/``extra_key``; because the key
is a tuple, not a concatenated string, no client-chosen salt can collide with an adapter id
(SGLang issue #24638).

The cache stores opaque state objects together with the token tuple they cover; the caller
decides how to copy and crop them (see :mod:`engines.local.model`). It is a plain LRU bounded by
entry count, touched only from the model worker (callers serialise access).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

State = TypeVar("State")

BASE_KEY = "__base__"


class PrefixHit(Generic[State]):
    """The best entry for a prompt: ``usable`` leading tokens of ``state`` can be reused."""

    __slots__ = ("state", "usable")

    def __init__(self, state: State, usable: int) -> None:
        self.state = state
        self.usable = usable


class PrefixCache(Generic[State]):
    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str, tuple[int, ...]], State] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, adapter_key: str, namespace: str, tokens: tuple[int, ...]
    ) -> PrefixHit[State] | None:
        """Longest common prefix with any entry of the same (adapter, namespace).

        At most ``len(tokens) - 1`` tokens are reusable: the last prompt token is always
        recomputed, because its logits start the generation."""
        best: tuple[int, tuple[str, str, tuple[int, ...]]] | None = None
        limit = len(tokens) - 1
        if limit <= 0 or self.max_entries <= 0:
            return None
        for key in self._entries:
            if key[0] != adapter_key or key[1] != namespace:
                continue
            common = _common_prefix(key[2], tokens)
            usable = min(common, limit)
            if usable > 0 and (best is None or usable > best[0]):
                best = (usable, key)
        if best is None:
            return None
        self._entries.move_to_end(best[1])
        return PrefixHit(self._entries[best[1]], best[0])

    def store(
        self, adapter_key: str, namespace: str, tokens: tuple[int, ...], state: State
    ) -> None:
        if self.max_entries <= 0 or not tokens:
            return
        key = (adapter_key, namespace, tokens)
        self._entries[key] = state
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def invalidate(self, adapter_key: str) -> int:
        """Drop every entry of a freed adapter incarnation (memory only: its key is never
        reused, so a stale entry could not be hit anyway)."""
        doomed = [k for k in self._entries if k[0] == adapter_key]
        for key in doomed:
            del self._entries[key]
        return len(doomed)

    def clear(self) -> None:
        self._entries.clear()


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
