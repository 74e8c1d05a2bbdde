"""The engine: sequences and KV blocks (notebook 03), the model runner, its step inputs, CUDA graphs and
tensor-parallel workers (notebook 04), the scheduler (notebook 05) and the engine loop (notebook 06)."""
