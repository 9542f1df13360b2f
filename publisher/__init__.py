"""The writer side: commands, the pure decider, the single-writer ledger service and drivers."""
