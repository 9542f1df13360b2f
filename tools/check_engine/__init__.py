"""``loraledger check-engine``: does *this* live engine behave the way the ledger relies on?

A team adopting loraledger runs it against its own SGLang or vLLM server (on the GPU host,
before the first publication) and the project runs it whenever a GPU machine is at hand. It
publishes a few throwaway adapters of the right shapes for the engine's base model, through
the same adapters the ledger uses (:class:`~engines.sglang.SGLangEngine`,
:class:`~engines.vllm.VLLMEngine`, :class:`~engines.local.client.LocalHTTPEngine`) and the same
engine protocol (:mod:`publisher.drivers.engine_protocol`: a load counts only once a fresh inventory
confirms it), and checks each property of docs/engines.md that publication, pinning and reclaim
rest on:

====================  ========  ==================================================================
check                 needed    what holds when it passes
====================  ========  ==================================================================
incarnation           yes       a non-empty id, stable across probes, carried by the inventory
load_and_list         yes       a published adapter is listed under its name
digest_confirmed      yes       the listing (or the receipt) names the published digest
adapter_applied       yes       greedy tokens with the adapter differ from the base, repeatably
same_name_reload      yes       other weights under a live name are refused; the name keeps its
                                weights (nothing swaps a version under running sessions)
unload_in_flight      yes       a request running during the unload finishes on its adapter
unload_drains         no        whether the unload waits for that request (SGLang) or answers at
                                once (vLLM); the ledger's in-flight count covers both
refused_after_unload  yes       the name is gone from the inventory; a repeated unload is a no-op
no_implicit_reload    no        a request naming an unloaded adapter is refused (stock SGLang
                                reloads it from its path: the gateway must never send such names)
prefix_cache          yes       a version never reads another version's prefix cache
tensor_vs_path        yes*      tensor (or staged) and path loads of one adapter give the same
                                tokens (*only where the engine offers both)
left_as_found         yes       the engine holds exactly what it held before the check
====================  ========  ==================================================================

The engine is left as it was found: every throwaway adapter is unloaded (and its directory
deleted) in a ``finally``, whatever failed. The engine is restarted only when asked
(``--restart-command``, :attr:`Target.restart`): then ``restart_detected`` (needed) checks that
the incarnation changes across the restart and ``restart_forgets`` (reported) whether the
restarted engine still lists what was loaded before it. A restart drops every adapter the
engine held, so give it an engine that holds nothing, or ``left_as_found`` says what was lost.

Its rooms: :mod:`.checks` (the checks, run against a :class:`Target`, so tests can drive them
against a deliberately misbehaving engine), :mod:`.live` (building the target for a live URL:
:func:`check_engine`), :mod:`.report` (the report, its table and its JSON).
"""

from tools.check_engine.checks import Target, run_checks
from tools.check_engine.live import KINDS, CheckOptions, build_target, check_engine, check_options
from tools.check_engine.report import Finding, Report, as_json, render

__all__ = [
    "KINDS",
    "CheckOptions",
    "Finding",
    "Report",
    "Target",
    "as_json",
    "build_target",
    "check_engine",
    "check_options",
    "render",
    "run_checks",
]
