"""The CPU KV pool's default size follows the host memory available (half of it, at most
8 GiB, at least 256 MiB), read from /proc/meminfo and the memory cgroups; the pool's
memory is committed only as blocks are written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.host_memory import available_bytes, cgroup_headroom_bytes, meminfo_available_bytes
from engine.kv_cache import KVCache, bytes_per_block, default_cpu_kv_bytes, plan_kv_blocks, populate_blocks

GIB, MIB = 1 << 30, 1 << 20


def _model() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_scaling=None, max_model_len=512, tie_word_embeddings=True,
                       attention_bias=False, bos_token_id=None, eos_token_ids=(0,))


@pytest.mark.parametrize(("available", "budget"), [
    (None, 1 * GIB),            # unknown: the old fixed budget
    (64 * MIB, 256 * MIB),      # a tiny host still gets a pool
    (600 * MIB, 300 * MIB),     # half of it
    (6 * GIB, 3 * GIB),
    (16 * GIB, 8 * GIB),        # the bound is reached at 16 GiB free
    (200 * GIB, 8 * GIB),       # and held beyond
])
def test_the_default_budget_is_half_the_available_memory_between_256_mib_and_8_gib(
        available: int | None, budget: int) -> None:
    assert default_cpu_kv_bytes(available) == budget


def test_without_a_budget_the_cpu_plan_takes_the_default_of_the_memory_available() -> None:
    mc = _model()
    cfg = EngineConfig(device="cpu", dtype="bfloat16")
    assert cfg.kv_cache_bytes is None
    per_block = bytes_per_block(mc, 16, torch.bfloat16)
    plan = plan_kv_blocks(mc, cfg, "cpu", available_bytes=6 * GIB)
    assert plan.num_blocks == (3 * GIB) // per_block
    assert "half the 6.00 GiB of host memory available" in plan.describe()
    # a set budget wins over the rule, and says nothing about memory
    fixed = plan_kv_blocks(mc, EngineConfig(device="cpu", dtype="bfloat16", kv_cache_bytes=10 * per_block), "cpu",
                           available_bytes=6 * GIB)
    assert fixed.num_blocks == 10 and "available" not in fixed.describe()


def test_meminfo_gives_memavailable_in_bytes(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24683652 kB\nMemFree:         1000000 kB\nMemAvailable:   22248284 kB\n")
    assert meminfo_available_bytes(f) == 22248284 * 1024
    f.write_text("MemTotal:       24683652 kB\nMemFree:         1000000 kB\n")  # a kernel before 3.14
    assert meminfo_available_bytes(f) == 1000000 * 1024
    assert meminfo_available_bytes(tmp_path / "missing") is None


def _cgroup_v2(root: Path, rel: str, limits: dict[str, tuple[str, int, int]]) -> Path:
    """A fake v2 hierarchy: ``limits`` maps a folder under ``root`` to (memory.max,
    memory.current, inactive_file)."""
    for folder, (limit, current, inactive) in limits.items():
        d = root / folder if folder else root
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(limit + "\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text(f"anon 5\ninactive_file {inactive}\nactive_file 7\n")
    self_cgroup = root.parent / "self_cgroup"
    self_cgroup.write_text(f"0::/{rel}\n")
    return self_cgroup


def test_a_v2_cgroup_limit_on_any_ancestor_lowers_the_headroom(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    self_cgroup = _cgroup_v2(root, "box/app", {
        "": ("max", 10 * GIB, 0),
        "box": (str(4 * GIB), 3 * GIB, 512 * MIB),  # the container's limit, one level up
        "box/app": ("max", 2 * GIB, 0),
    })
    # 4 GiB - (3 GiB - 0.5 GiB of inactive file cache the kernel reclaims first)
    assert cgroup_headroom_bytes(root, self_cgroup) == 4 * GIB - 3 * GIB + 512 * MIB


def test_no_cgroup_limit_means_no_headroom_bound(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    assert cgroup_headroom_bytes(root, _cgroup_v2(root, "app", {"": ("max", 1, 0), "app": ("max", 1, 0)})) is None
    # v1 says "no limit" with a huge number
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (tmp_path / "self_v1").write_text("4:memory:/elsewhere\n0::/\n")
    assert cgroup_headroom_bytes(v1, tmp_path / "self_v1") is None


def test_a_v1_memory_limit_is_read_from_the_controller(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (v1 / "memory" / "memory.stat").write_text(f"cache 9\ntotal_inactive_file {256 * MIB}\n")
    (tmp_path / "self_v1").write_text("4:memory:/docker/abc\n")  # a container sees its own cgroup at the root
    assert cgroup_headroom_bytes(v1, tmp_path / "self_v1") == GIB + 256 * MIB


def test_available_memory_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemAvailable: {20 * GIB // 1024} kB\n")
    (proc / "self" / "cgroup").write_text("0::/app\n")
    root = tmp_path / "cg"
    _cgroup_v2(root, "app", {"app": (str(3 * GIB), GIB, 0)})
    assert available_bytes(proc, root) == 2 * GIB
    (root / "app" / "memory.max").write_text("max\n")
    assert available_bytes(proc, root) == 20 * GIB


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_a_large_cpu_pool_is_zeros_and_commits_memory_only_where_written() -> None:
    mc = _model()
    blocks = (2 * GIB) // bytes_per_block(mc, 16, torch.bfloat16)  # a 2 GiB pool
    before = _rss_bytes()
    kv = KVCache.allocate(mc, blocks, 16, torch.bfloat16, "cpu")
    assert kv.num_bytes >= 2 * GIB - bytes_per_block(mc, 16, torch.bfloat16)
    assert _rss_bytes() - before < 256 * MIB  # not filled up front
    # every layer's K and V is its own zeroed memory
    for i, t in enumerate(kv.k_caches + kv.v_caches):
        assert t.is_contiguous() and t.shape == (blocks, 16, 2, 16)
        t[blocks - 1 - i].fill_(i + 1)
    for i, t in enumerate(kv.k_caches + kv.v_caches):
        assert int(torch.count_nonzero(t)) == 16 * 2 * 16 and float(t[blocks - 1 - i].max()) == i + 1
        assert float(t[0].abs().max()) == 0.0
    assert {t.dtype for t in kv.k_caches + kv.v_caches} == {torch.bfloat16}


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_populating_blocks_faults_them_in_without_changing_a_byte() -> None:
    mc = _model()
    blocks = (512 * MIB) // bytes_per_block(mc, 16, torch.bfloat16)
    kv = KVCache.allocate(mc, blocks, 16, torch.bfloat16, "cpu")
    kv.k_caches[1][7].fill_(3.0)  # a block someone wrote meanwhile keeps its bytes
    before = _rss_bytes()
    want = list(range(0, blocks, 2))  # every other block: about half the pool
    assert populate_blocks(kv.k_caches, kv.v_caches, want)
    assert _rss_bytes() - before > 128 * MIB  # the memory is there now
    assert float(kv.k_caches[1][7].min()) == 3.0 and int(torch.count_nonzero(kv.k_caches[1])) == 16 * 2 * 16
    assert int(torch.count_nonzero(kv.v_caches[0])) == 0
