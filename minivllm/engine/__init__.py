"""The engine: sequences and KV blocks (notebook 03), the model runner, its step inputs and CUDA graphs
(notebook 04), the schedulers (notebook 05), tensor-parallel workers and the engine loop (notebook 06)."""
