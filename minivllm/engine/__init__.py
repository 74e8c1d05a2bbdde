"""The engine's bookkeeping: sequences, KV block management, and (later) the scheduler and the engine loop."""
