"""One serialization of a KV page (engine.kv_page): round trip, and every kind of bad
page refused with a clear error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_page import (
    PageError,
    PageHeader,
    PageKey,
    StalePageError,
    decode_page,
    encode_page,
    encode_page_parts,
    gather_block,
    gather_blocks,
    scatter_block,
    scatter_blocks,
    scope_digest,
)

KEY = PageKey(model_id="0123456789abcdef", weight_format="int8", kv_dtype="bfloat16", block_size=4,
              num_layers=3, num_kv_heads=2, head_dim=8)


def _page(key: PageKey = KEY, seed: int = 0) -> tuple[PageHeader, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(key.shape, generator=g).to(key.torch_dtype)
    header = PageHeader(key, scope_digest("ns|", "user-1"), chain_hash=2**64 - 5, parent_hash=42,
                        token_ids=tuple(range(100, 100 + key.block_size)))
    return header, kv


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16"])
def test_page_round_trips_bit_exact_per_kv_dtype(kv_dtype: str) -> None:
    key = dataclasses.replace(KEY, kv_dtype=kv_dtype)
    header, kv = _page(key)
    data = encode_page(header, kv)
    assert len(data) > key.payload_bytes
    page = decode_page(data, key, scope=header.scope, chain_hash=header.chain_hash, parent_hash=42,
                       token_ids=header.token_ids)
    assert page.header == header
    assert page.kv.dtype == kv.dtype and torch.equal(page.kv.view(torch.uint8), kv.view(torch.uint8))


def test_every_flipped_byte_is_detected() -> None:
    header, kv = _page()
    data = encode_page(header, kv)
    for pos in range(0, len(data), 7):  # header, payload and digest alike
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(PageError):
            decode_page(bytes(bad), KEY)


@pytest.mark.parametrize("cut", [0, 5, 100, -1, -17])
def test_truncated_page_is_detected(cut: int) -> None:
    header, kv = _page()
    data = encode_page(header, kv)
    with pytest.raises(PageError, match="truncated|checksum"):
        decode_page(data[:cut], KEY)


@pytest.mark.parametrize("field,value", [("model_id", "fedcba9876543210"), ("weight_format", "bfloat16"),
                                         ("kv_dtype", "float32"), ("block_size", 8), ("num_layers", 4)])
def test_page_of_another_model_or_format_never_matches(field: str, value: object) -> None:
    header, kv = _page()
    data = encode_page(header, kv)
    other = dataclasses.replace(KEY, **{field: value})
    with pytest.raises(StalePageError, match=field):
        decode_page(data, other)


def test_page_of_another_salt_hash_or_tokens_never_matches() -> None:
    header, kv = _page()
    data = encode_page(header, kv)
    with pytest.raises(StalePageError, match="scope"):
        decode_page(data, KEY, scope=scope_digest("ns|", "user-2"))
    with pytest.raises(StalePageError, match="chain hash"):
        decode_page(data, KEY, chain_hash=7)
    with pytest.raises(StalePageError, match="parent hash"):
        decode_page(data, KEY, parent_hash=43)
    with pytest.raises(StalePageError, match="tokens"):
        decode_page(data, KEY, token_ids=(1, 2, 3, 4))


def test_scope_digest_hides_the_salt_and_separates_scopes() -> None:
    assert "user-1" not in scope_digest("ns|", "user-1")
    assert scope_digest("ns|", "a") != scope_digest("ns|", "b") != scope_digest("ns|")
    assert scope_digest("ns|a", "") != scope_digest("ns|", "a")


def test_another_version_is_refused() -> None:
    import struct
    import zlib

    header, kv = _page()
    data = bytearray(encode_page(header, kv))
    struct.pack_into("<H", data, 4, 99)
    body = bytes(data[:-4])
    data[-4:] = zlib.crc32(body).to_bytes(4, "little")
    with pytest.raises(PageError, match="version 99"):
        decode_page(bytes(data), KEY)


def test_encode_refuses_a_tensor_of_another_shape_or_dtype() -> None:
    header, kv = _page()
    with pytest.raises(ValueError, match="key says"):
        encode_page(header, kv.float())
    with pytest.raises(ValueError, match="key says"):
        encode_page(header, kv[:, :, :2])


def test_gather_and_scatter_move_one_block_between_caches() -> None:
    shape = (5, KEY.block_size, KEY.num_kv_heads, KEY.head_dim)
    k = [torch.randn(shape).to(torch.bfloat16) for _ in range(KEY.num_layers)]
    v = [torch.randn(shape).to(torch.bfloat16) for _ in range(KEY.num_layers)]
    page = gather_block(k, v, 3)
    assert tuple(page.shape) == KEY.shape
    k2 = [torch.zeros_like(t) for t in k]
    v2 = [torch.zeros_like(t) for t in v]
    header, _ = _page()
    scatter_block(k2, v2, 1, decode_page(encode_page(header, page), KEY).kv)
    for a, b, c, d in zip(k, k2, v, v2):
        assert torch.equal(a[3], b[1]) and torch.equal(c[3], d[1])
        assert not b[0].any() and not b[2].any()


def test_batched_gather_and_scatter_equal_the_one_block_ones() -> None:
    shape = (6, KEY.block_size, KEY.num_kv_heads, KEY.head_dim)
    k = [torch.randn(shape).to(torch.bfloat16) for _ in range(KEY.num_layers)]
    v = [torch.randn(shape).to(torch.bfloat16) for _ in range(KEY.num_layers)]
    many = gather_blocks(k, v, [4, 1, 5])
    assert all(torch.equal(many[i], gather_block(k, v, b)) for i, b in enumerate([4, 1, 5]))
    k2 = [torch.zeros_like(t) for t in k]
    v2 = [torch.zeros_like(t) for t in v]
    scatter_blocks(k2, v2, [0, 3, 2], list(many))
    for i, b in enumerate([0, 3, 2]):
        assert torch.equal(gather_block(k2, v2, b), many[i])
    assert not gather_block(k2, v2, 1).any()


def test_decode_into_a_given_buffer_reads_the_same_bytes() -> None:
    header, kv = _page()
    out = torch.empty((2, *KEY.shape), dtype=KEY.torch_dtype)
    page = decode_page(encode_page(header, kv), KEY, out=out[1])
    assert page.kv.data_ptr() == out[1].data_ptr() and torch.equal(out[1].view(torch.uint8), kv.view(torch.uint8))
    with pytest.raises(ValueError, match="out is"):
        decode_page(encode_page(header, kv), KEY, out=out[1].float())


def test_page_parts_written_in_order_are_the_encoded_page() -> None:
    key = PageKey("m", "int8", "bfloat16", 4, 2, 1, 8)
    kv = torch.randn(key.shape).to(torch.bfloat16)
    header = PageHeader(key, "s", 7, 6, (1, 2, 3, 4))
    parts = encode_page_parts(header, kv)
    joined = b"".join(bytes(p) for p in parts)
    assert joined == encode_page(header, kv)
    assert torch.equal(decode_page(joined, key).kv, kv)
