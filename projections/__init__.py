"""Folds from events to state (registry and its transitions table, status, session history,
version timelines), and ``recovery``, which feeds the registry fold from a store. No clock, no
engines: the same log always folds to the same state."""
