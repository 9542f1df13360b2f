"""The append-only log: event vocabulary, record envelope, hash chain and stores."""
