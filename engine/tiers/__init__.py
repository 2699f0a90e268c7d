"""KV tiers beneath the pool's radix cache: today a disk tier (``engine.tiers.disk``)
driven by ``engine.tiers.manager.KVTiers``; see docs/kv_tiers.md."""
