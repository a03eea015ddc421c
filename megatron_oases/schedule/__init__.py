"""The Oases overlapped TMP schedule (paper §3): blocks, executor, engine, patch, tracer."""
