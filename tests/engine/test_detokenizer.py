"""Incremental detokenizer: streamed pieces equal the one-shot decode, no broken UTF-8,
no stop-string leaks (docs/acceptance.md: stop strings, the finishing step, spaces,
UTF-8), for byte-level BPE (SmolLM2) and SentencePiece-style byte-fallback tokenizers."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, clean_text, decode_text

TEXTS = [
    "LLMs. It is a test. It works.",
    "Hello,  double spaces and   triple ones.",
    "first line\n  a leading space inside a line\n indented after newline",
    "Lighthouses guide ships.\n It rains.\n\n Next paragraph.",
    "日本語のテキスト and 中文 mixed 😀🎉 emoji 👩‍👩‍👧 family",
    "Café au lait, naïve résumé, Ångström, ß, ñandú.",
    " leading space and trailing space ",
]

SP_CORPUS = [
    "LLMs. It is a test of the lighthouse keeper.",
    "Hello,  double spaces here.\n indented line",
    "The quick brown fox jumps over the lazy dog.",
    "Café au lait, naïve résumé.",
    "It was the best of times, it was the worst of times.",
    "日本語 😀",
]


# The real tokenizer comes with the default model's files (the trained ones need none).
SMOLLM2 = pytest.param("smollm2", marks=pytest.mark.model)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The real SmolLM2 tokenizer (byte-level BPE)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def _sentencepiece_style(decoder_style: str):
    """A small BPE tokenizer trained in-test, Llama-2 style: '▁' word marker, 256
    ``<0xNN>`` byte-fallback tokens, a decoder that drops the first leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if decoder_style == "llama2":  # Llama-2's tokenizer.json: normalizer + Strip decoder
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:  # Metaspace pre-tokenizer and decoder
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    # A small alphabet so that CJK and emoji fall back to byte tokens.
    trainer = trainers.BpeTrainer(vocab_size=220, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40)
    tok.train_from_iterator(SP_CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [dict(t, id=vocab[t["content"]]) for t in spec["added_tokens"]]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="session")
def sp_llama2_tokenizer():
    return _sentencepiece_style("llama2")


@pytest.fixture(scope="session")
def sp_metaspace_tokenizer():
    return _sentencepiece_style("metaspace")


@pytest.fixture(params=[SMOLLM2, "sp_llama2", "sp_metaspace"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def stream(tok, ids, stop=(), skip_special_tokens=True) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``ids`` one at a time, then finish; return the detokenizer and all pieces."""
    detok = IncrementalDetokenizer(tok, list(stop), skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.finish())
    return detok, pieces


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def byte_token_id(tok, byte: int) -> int:
    """The id of the single-byte token for ``byte`` (SentencePiece ``<0xNN>`` or byte-level char)."""
    sp = tok.convert_tokens_to_ids(f"<0x{byte:02X}>")
    if sp is not None and sp != tok.unk_token_id:
        return sp
    # GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves.
    return tok.convert_tokens_to_ids(bytes([byte]).decode("latin-1"))


# -- streaming equals the one-shot decode -------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_concatenate_to_one_shot_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    detok, pieces = stream(tokenizer, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == expected == detok.text == decode_text(tokenizer, ids)
    assert detok.token_ids == ids and not detok.stopped
    # Valid text never streams a replacement character, and every piece is sendable.
    assert all("\ufffd" not in p for p in pieces)
    for p in pieces:
        p.encode("utf-8")


def test_byte_level_round_trip_keeps_every_space(smollm2_tokenizer):
    for text in TEXTS:
        _, pieces = stream(smollm2_tokenizer, encode(smollm2_tokenizer, text))
        assert "".join(pieces) == text


def test_spaces_at_token_boundaries_are_kept(tokenizer):
    ids = encode(tokenizer, "LLMs. It is,  here.\n indented")
    detok, pieces = stream(tokenizer, ids)
    assert ". It is,  here.\n indented" in detok.text  # not ".It" (spaces kept at token boundaries)
    assert "".join(pieces) == detok.text


def test_first_piece_has_no_spurious_leading_space(sp_llama2_tokenizer, sp_metaspace_tokenizer):
    for tok in (sp_llama2_tokenizer, sp_metaspace_tokenizer):
        ids = encode(tok, "It is")
        assert tok.convert_ids_to_tokens(ids)[0].startswith("▁")  # the word marker is there...
        _, pieces = stream(tok, ids)
        first = next(p for p in pieces if p)
        assert first.startswith("I")  # ...but, as in the one-shot decode, not as text
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == "It is"


def test_multibyte_characters_are_emitted_whole(tokenizer):
    text = "a 中文 🎉 é z"  # not in the SentencePiece training corpus: byte tokens there
    ids = encode(tokenizer, text)
    # Some characters really are split over several tokens, or the test proves nothing.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok, pieces = stream(tokenizer, ids)
    chars = set("中文🎉é")
    for p in pieces:
        assert "\ufffd" not in p
    assert "".join(pieces) == detok.text and chars <= set(detok.text)


def test_each_token_costs_a_bounded_decode_window(smollm2_tokenizer):
    """O(1) work per token: decode never sees more than a few recent tokens."""
    seen: list[int] = []

    class Spy:
        def __getattr__(self, name):
            return getattr(smollm2_tokenizer, name)

        def decode(self, ids, **kw):
            seen.append(len(ids))
            return smollm2_tokenizer.decode(ids, **kw)

    ids = encode(smollm2_tokenizer, " ".join(TEXTS) * 4)
    assert len(ids) > 200
    detok, pieces = stream(Spy(), ids)
    assert "".join(pieces) == decode_text(smollm2_tokenizer, ids)
    assert max(seen) <= 8


def test_special_tokens_are_skipped_or_kept_like_one_shot_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = encode(tok, "Hi there") + [tok.convert_tokens_to_ids("<|im_start|>")] + encode(tok, " friend")
    for skip in (True, False):
        _, pieces = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_start|>" not in "".join(stream(tok, ids)[1])


# -- stop strings --------------------------------------------------------------------


def test_stop_string_split_across_tokens_never_leaks(smollm2_tokenizer):
    tok = smollm2_tokenizer
    parts = ["ABC ", "DEF", "G", "HI", "J", " KLM"]
    ids = [i for part in parts for i in encode(tok, part)]
    detok = IncrementalDetokenizer(tok, ["DEFGHIJ"])
    emitted = ""
    for i in ids:
        emitted += detok.add(i)
        assert "D" not in emitted  # no part of the stop string is ever streamed
    emitted += detok.finish()
    assert emitted == detok.text == "ABC "
    assert detok.stopped and detok.stop_reason == "DEFGHIJ"
    assert detok.add(encode(tok, "more")[0]) == ""  # nothing after the stop


def test_held_back_stop_prefix_is_flushed_when_stream_ends_otherwise(tokenizer):
    ids = encode(tokenizer, "It ends with DEFG")
    detok = IncrementalDetokenizer(tokenizer, ["DEFGHIJ"])
    streamed = "".join(detok.add(i) for i in ids)
    assert not streamed.endswith("G")  # "DEFG" could still become the stop string
    tail = detok.finish()
    assert streamed + tail == detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert tail.endswith("DEFG") and not detok.stopped and detok.stop_reason is None


def test_stop_string_at_the_very_start(tokenizer):
    detok, pieces = stream(tokenizer, encode(tokenizer, "Hello world, more text"), stop=["Hello"])
    assert pieces == [""] * len(pieces) and detok.text == ""
    assert detok.stop_reason == "Hello"


@pytest.mark.parametrize(
    "text,stops,expected,reason",
    [
        ("in the end we go", ["the end", "the"], "in ", "the"),  # the shorter one completes first
        ("a category b", ["category", "cat"], "a ", "cat"),
        ("x abc y", ["bc", "abc"], "x ", "abc"),  # both end together: the earlier start wins
        ("line one\n\nline two STOP", ["STOP", "\n\n"], "line one", "\n\n"),
        ("one two STOP three\n\n", ["\n\n", "STOP"], "one two ", "STOP"),
    ],
)
def test_overlapping_and_multiple_stop_strings(tokenizer, text, stops, expected, reason):
    detok, pieces = stream(tokenizer, encode(tokenizer, text), stop=stops)
    full = tokenizer.decode(encode(tokenizer, text), skip_special_tokens=True)
    assert full.startswith(expected)
    assert "".join(pieces) == detok.text == expected
    assert detok.stopped and detok.stop_reason == reason


def test_stop_string_completed_in_the_final_flush_still_cuts(sp_llama2_tokenizer):
    """A byte-fallback character is held until its run ends; a stop on it still applies."""
    tok = sp_llama2_tokenizer
    ids = encode(tok, "ok 日🎉")
    assert tok.convert_ids_to_tokens(ids[-1]).startswith("<0x")  # 🎉 is not in the trained vocab
    detok = IncrementalDetokenizer(tok, ["🎉"])
    streamed = "".join(detok.add(i) for i in ids)
    assert not detok.stopped and "🎉" not in streamed
    streamed += detok.finish()
    assert detok.text == streamed == "ok 日" and detok.stop_reason == "🎉"


# -- invalid UTF-8 and surrogates (valid UTF-8 always) ----------------------------------------------


def test_lone_lead_byte_at_end_becomes_replacement_at_finish(tokenizer):
    ids = encode(tokenizer, "ok then") + [byte_token_id(tokenizer, 0xE6)]
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.add(i) for i in ids)
    assert "\ufffd" not in streamed  # held back while it might still complete
    tail = detok.finish()
    assert tail.endswith("\ufffd")
    assert streamed + tail == detok.text == decode_text(tokenizer, ids)
    detok.text.encode("utf-8")


def test_invalid_byte_in_the_middle_matches_one_shot_decode(tokenizer):
    ids = encode(tokenizer, "a") + [byte_token_id(tokenizer, 0xE6)] + encode(tokenizer, " b 日")
    detok, pieces = stream(tokenizer, ids)
    assert "".join(pieces) == decode_text(tokenizer, ids) and "\ufffd" in detok.text


def test_lone_surrogate_from_a_decode_path_is_replaced(smollm2_tokenizer):
    class SurrogateDecoder:
        """A tokenizer whose decode yields a lone surrogate after token ``bad`` (as a slow
        tokenizer decoding with errors='surrogateescape' would)."""

        bad = encode(smollm2_tokenizer, "!")[0]

        def __getattr__(self, name):
            return getattr(smollm2_tokenizer, name)

        def decode(self, ids, **kw):
            return "".join(
                "\udce6" if i == self.bad else smollm2_tokenizer.decode([i], **kw) for i in ids
            )

    tok = SurrogateDecoder()
    ids = encode(smollm2_tokenizer, "Hi") + [tok.bad] + encode(smollm2_tokenizer, " there")
    detok, pieces = stream(tok, ids)
    for p in pieces:
        p.encode("utf-8")
    assert detok.text == "Hi\ufffd there" == decode_text(tok, ids)


def test_clean_text_replaces_only_lone_surrogates():
    assert clean_text("plain é 日 😀") == "plain é 日 😀"
    assert clean_text("a\ud800b\udfffc") == "a\ufffdb\ufffdc"
    assert clean_text("\ud83d\ude00") == "😀"  # a split pair is rejoined
    assert clean_text("x\ud83d") == "x\ufffd"


@pytest.mark.parametrize("stop", [[], ["Hi there"]])
def test_single_token_stream_delivers_its_text(smollm2_tokenizer, stop):
    """max_tokens=1 (the finishing step's token): the one token's text comes out of add, or of finish when a
    stop prefix held it back."""
    ids = encode(smollm2_tokenizer, "Hi")
    assert len(ids) == 1
    detok = IncrementalDetokenizer(smollm2_tokenizer, stop)
    first = detok.add(ids[0])
    assert first == ("" if stop else "Hi")
    assert first + detok.finish() == detok.text == "Hi"


def test_finish_is_idempotent_and_add_after_finish_is_ignored(tokenizer):
    ids = encode(tokenizer, "done here")
    detok, pieces = stream(tokenizer, ids)
    assert detok.finish() == "" and detok.add(ids[0]) == ""
    assert detok.text == "".join(pieces) and detok.token_ids == ids


# -- property tests ---------------------------------------------------------------------


def _id_strategy(tok):
    """Any id, with extra weight on byte tokens, special tokens and tokens of real text."""
    vocab = tok.get_vocab()
    byte_ids = sorted(i for t, i in vocab.items() if len(t) == 1 or (len(t) == 6 and t.startswith("<0x")))
    text_ids = sorted(set(encode(tok, " ".join(TEXTS))))
    specials = sorted(set(tok.all_special_ids))
    return st.one_of(
        st.integers(0, len(tok) - 1),
        st.sampled_from(byte_ids),
        st.sampled_from(text_ids),
        st.sampled_from(specials),
    )


def _expected_stop_cut(full: str, stops: list[str]) -> tuple[str, str | None]:
    """Reference: the match that ends first in the one-shot text (ties: starts first)."""
    best = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return (full, None) if best is None else (full[: best[1]], best[2])


@pytest.mark.parametrize("name", [SMOLLM2, "sp_llama2", "sp_metaspace"])
def test_random_ids_stream_equals_clean_one_shot_decode(request, name):
    tok = request.getfixturevalue(f"{name}_tokenizer")

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ids=st.lists(_id_strategy(tok), min_size=0, max_size=24))
    def check(ids):
        detok, pieces = stream(tok, ids)
        for p in pieces:
            p.encode("utf-8")
        assert "".join(pieces) == detok.text == clean_text(tok.decode(ids, skip_special_tokens=True))

    check()


@pytest.mark.parametrize("name", [SMOLLM2, "sp_llama2"])
def test_random_ids_with_stop_strings_cut_at_first_match(request, name):
    tok = request.getfixturevalue(f"{name}_tokenizer")

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data(), ids=st.lists(_id_strategy(tok), min_size=1, max_size=24))
    def check(data, ids):
        full = decode_text(tok, ids)
        # Stop strings taken from the text itself (so they do match), plus one that may not.
        n = data.draw(st.integers(1, 3))
        stops = []
        for _ in range(n):
            if full:
                a = data.draw(st.integers(0, len(full) - 1))
                b = data.draw(st.integers(a + 1, min(len(full), a + 6)))
                stops.append(full[a:b])
        stops.append(data.draw(st.text(min_size=1, max_size=3)))
        detok, pieces = stream(tok, ids, stop=stops)
        expected, reason = _expected_stop_cut(full, stops)
        assert "".join(pieces) == detok.text == expected
        assert detok.stop_reason == reason
        for p in pieces:
            p.encode("utf-8")

    check()


# -- cut replies and their continuations --------------------------------------------------
#
# A reply cut by max_tokens (or the context, or an abort) ends with ``finish(complete=False)``
# and never ends in U+FFFD; a Continue replays the cut reply's ids (``prior_ids``) and the
# two together show exactly the text of one uncut reply (less ``trim`` characters of the
# shown text when a stop string or a re-decoded byte run takes them back).

CUT_TEXTS = [
    "今天天气很好，我们去公园。",
    "emoji 😀🎉 and a family 👩‍👩‍👧 here",
    "Grüße aus Köln — naïve café",
    "mixed 日本語 text, Ελληνικά and русский 🙂 ok",
]


def cut_then_continue(tok, ids: list[int], cuts: list[int], stop=()) -> tuple[str, str | None, list[str]]:
    """Generate ``ids`` in parts: cut (``finish(complete=False)``) after each position of
    ``cuts`` and continue with the ids so far as ``prior_ids``; returns the text the parts
    add up to (each continuation taking back its ``trim`` first), the stop string that
    ended it, and the text shown at each cut."""
    shown, start = "", 0
    at_cuts: list[str] = []
    for end in [*cuts, len(ids)]:
        detok = IncrementalDetokenizer(tok, list(stop), prior_ids=ids[:start])
        pieces = [detok.add(i) for i in ids[start:end]]
        pieces.append(detok.finish(complete=end == len(ids)))
        assert detok.text == "".join(pieces)
        shown = shown[: len(shown) - detok.trim] + detok.text
        if detok.stopped:
            return shown, detok.stop_reason, at_cuts
        at_cuts.append(shown)
        start = end
    return shown, None, at_cuts[:-1]


def test_a_cut_inside_a_character_drops_its_bytes_instead_of_showing_a_replacement(tokenizer):
    inside = 0
    for text in CUT_TEXTS:
        ids = encode(tokenizer, text)
        for c in range(1, len(ids)):
            detok = IncrementalDetokenizer(tokenizer)
            streamed = "".join(detok.add(i) for i in ids[:c]) + detok.finish(complete=False)
            full = decode_text(tokenizer, ids[:c])
            inside += full.endswith("\ufffd")
            assert streamed == detok.text == full.rstrip("\ufffd"), (text, c)
            assert not streamed.endswith("\ufffd") and text.startswith(streamed.lstrip())
    assert inside > 3  # cuts really fell inside characters, or this proves nothing


def test_a_reply_that_truly_ends_on_an_incomplete_character_still_shows_a_replacement(tokenizer):
    ids = encode(tokenizer, "ok then") + [byte_token_id(tokenizer, 0xE6)]
    for complete, tail in ((True, "\ufffd"), (False, "")):
        detok = IncrementalDetokenizer(tokenizer)
        out = "".join(detok.add(i) for i in ids) + detok.finish(complete=complete)
        assert out == "ok then" + tail


@pytest.mark.parametrize("text", CUT_TEXTS)
def test_continuing_at_every_cut_gives_the_uncut_text(tokenizer, text):
    ids = encode(tokenizer, text)
    whole = decode_text(tokenizer, ids)
    for c in range(1, len(ids)):
        shown, reason, at_cuts = cut_then_continue(tokenizer, ids, [c])
        assert (shown, reason) == (whole, None), (c, at_cuts)
        assert not at_cuts[0].endswith("\ufffd") and whole.startswith(at_cuts[0])
    for c1 in range(1, len(ids) - 1, 3):  # cut twice
        for c2 in range(c1 + 1, len(ids), 4):
            assert cut_then_continue(tokenizer, ids, [c1, c2])[0] == whole


@pytest.mark.parametrize("text, stops", [
    ("the green stone is heavy", ["green stone"]),
    ("the green stone is heavy", ["green stone", "stone is", "een s"]),
    ("今天天气很好，我们去公园。", ["天气很"]),
    ("emoji 😀🎉 and more", ["😀🎉 and"]),
    ("one two STOP three", ["STOP", "two S"]),
])
def test_a_stop_string_across_the_cut_ends_the_continuation_where_the_uncut_reply_ends(tokenizer, text, stops):
    ids = encode(tokenizer, text)
    uncut = stream(tokenizer, ids, stop=stops)[0]
    want, want_reason = uncut.text, uncut.stop_reason
    assert want_reason is not None
    trimmed = 0
    for c in range(1, len(ids)):
        detok = IncrementalDetokenizer(tokenizer, stops)
        cut = "".join(detok.add(i) for i in ids[:c]) + detok.finish(complete=False)
        shown, reason, _ = cut_then_continue(tokenizer, ids, [c], stops)
        assert (shown, reason) == (want, want_reason), (c, cut)
        if not detok.stopped and len(cut) > len(want):
            trimmed += 1  # the cut showed the start of the stop string; the continuation took it back
    assert trimmed > 0


def test_the_trim_is_reported_once_and_before_any_continuation_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = encode(tok, "the green stone is heavy")
    c = next(k for k in range(1, len(ids)) if decode_text(tok, ids[:k]).endswith("green"))
    detok = IncrementalDetokenizer(tok, ["green stone"], prior_ids=ids[:c])
    seen = []
    for i in ids[c:]:
        piece = detok.add(i)
        seen.append((piece, detok.take_trim()))
        if detok.stopped:
            break
    assert detok.stopped and detok.trim == len("green") and detok.text == ""
    assert [t for _, t in seen if t] == [len("green")] and all(p == "" for p, _ in seen)
    assert detok.take_trim() == 0


@pytest.mark.parametrize("name", [SMOLLM2, "sp_llama2", "sp_metaspace"])
def test_random_ids_cut_anywhere_and_continued_show_the_uncut_text(request, name):
    tok = request.getfixturevalue(f"{name}_tokenizer")

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data(), ids=st.lists(_id_strategy(tok), min_size=2, max_size=24))
    def check(data, ids):
        full = decode_text(tok, ids)
        stops = []
        for _ in range(data.draw(st.integers(0, 2))):
            if full:
                a = data.draw(st.integers(0, len(full) - 1))
                stops.append(full[a:data.draw(st.integers(a + 1, min(len(full), a + 6)))])
        cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), min_size=1, max_size=2)))
        want = stream(tok, ids, stop=stops)[0]
        shown, reason, at_cuts = cut_then_continue(tok, ids, cuts, stops)
        # a cut reply whose own text matched a stop ends there ("stop", not continuable);
        # it is the uncut reply's end whenever the cut's text is a prefix of the full text
        # (a SentencePiece byte run can decode whole at a cut and turn invalid later)
        before = decode_text(tok, ids[:cuts[0]]).rstrip("\ufffd")
        if reason is None or len(at_cuts) == len(cuts) or full.startswith(before):
            assert (shown, reason) == (want.text, want.stop_reason), (cuts, at_cuts)
        for t in at_cuts:
            t.encode("utf-8")
            if not any("\ufffd" in s for s in stops):
                assert not t.endswith("\ufffd")

    check()
