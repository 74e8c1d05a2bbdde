"""How a layer attends, apart from the model: the `Attention` layer and the contexts that do the
attending.

- `layer`: `Attention` and the `AttentionContext` protocol (notebook 02)
- `prefill`: `PrefillContext`, whole prompts without a KV cache (notebook 02)
- `paged`: `PagedContext`, a step over a paged KV cache: prefill chunks and decodes (notebook 04)
"""
