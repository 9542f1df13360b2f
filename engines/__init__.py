"""Engine adapters (local, SGLang, vLLM), adapter artifacts and the engine contract.

Imports nothing from the ledger: an engine does not know it is being managed.
"""
