"""KV tiers beneath the pool's radix cache: host memory (``engine.tiers.host``, on by
default on a GPU) and disk (``engine.tiers.disk``), driven by
``engine.tiers.manager.KVTiers``; see docs/kv_tiers.md."""
