"""The drivers: the slow, failure-prone work against engines, reported back to the ledger as
commands. ``engine_ops`` (bounded, classified engine calls), ``engine_protocol`` (how an adapter
is put on an engine and taken off, written once), ``fleet`` (the engine handles a process can
reach), ``publication`` / ``reclaim`` / ``reconciler`` (the three drivers), ``plane`` (the one
composition of ledger and drivers: :class:`ControlPlane`), and the trainer's side of a
publication: ``adapter_copy``, ``adapter_source``, ``trainer``."""
