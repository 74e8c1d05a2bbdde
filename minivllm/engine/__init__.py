"""The engine: sequences and KV blocks (notebook 03), the model runner, its step inputs and CUDA
graphs (notebook 04), the schedulers (notebook 05), the engine loop and its input and output
processors (notebook 06), tensor-parallel workers (the deep dive tensor_parallel)."""
