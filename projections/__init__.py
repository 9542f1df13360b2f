"""Pure folds from events to state: registry, session history, version timelines. No I/O."""
