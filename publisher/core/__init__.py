"""The ledger core: what a caller may ask (commands), what an accepted command answers
(outcomes), the ledger's refusals (errors), the pure decider that turns a command into events
or a refusal, the single-writer ledger that appends them, and owner leases.

Everything here decides or records; nothing here talks to an engine. The drivers, the
gateway and the faces sit around it and reach the log only through the ledger.
"""
