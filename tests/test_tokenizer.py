"""CharTokenizer layout and round trips; the HF adapter on a locally built tokenizer folder."""

from __future__ import annotations

import re
import string

import pytest

from tracerl.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_fixed_vocabulary_layout() -> None:
    tok = CharTokenizer()
    assert tok.vocab_size == 99
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("\n") == [3]
    assert tok.encode(" ") == [4] and tok.encode("~") == [98]
    assert tok.encode("A") == [4 + ord("A") - 32]
    assert isinstance(tok, Tokenizer)


def test_round_trip_of_every_printable_character() -> None:
    tok = CharTokenizer()
    text = "".join(chr(c) for c in range(32, 127)) + "\n" + string.printable.strip()
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(3 <= i < 99 for i in ids)
    assert tok.decode(ids) == text


def test_bos_and_specials() -> None:
    tok = CharTokenizer()
    ids = tok.encode("12+3=", add_bos=True) + [tok.eos_id, tok.pad_id]
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == "12+3="
    assert tok.decode(ids, skip_special=False) == "<bos>12+3=<eos><pad>"


@pytest.mark.parametrize("bad", ["é", "\t", "日本", "\x00"])
def test_unknown_character_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad[0]))):
        CharTokenizer().encode("ok" + bad)


def test_decode_rejects_ids_outside_vocab() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        CharTokenizer().decode([5, 120])


def test_load_tokenizer(tmp_path) -> None:
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))


def test_hf_tokenizer_from_a_local_folder(tmp_path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "hello": 4, "world": 5, "!": 6}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="[UNK]")
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) and tok.vocab_size == 7
    assert tok.encode("hello world") == [4, 5]
    assert tok.encode("hello", add_bos=True) == [1, 4]
    assert tok.decode([1, 4, 5, 2]) == "hello world"
    assert "</s>" in tok.decode([4, 2], skip_special=False)
