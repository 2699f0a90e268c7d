"""The LLM engine: paged KV blocks, a radix-tree prefix cache and continuous batching."""
