"""The engine: the loop, the scheduler and what it owns (KV cells, prefixes, sessions),
sampling and drafting. Internal: the public API is ``llamax``; nothing here imports the
facade or anything above it."""
