"""The bound a server checks a prompt's text against before tokenizing it: no token stands for
more than `Tokenizer.max_token_bytes` bytes of text, so a text of more bytes than the context
times that cannot fit. The bound is checked against the vocabulary itself, and it is refused
(None) for tokenizers that can turn any amount of text into one token or none."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from jfire.errors import RequestError
from jfire.request_checks import TextLimit
from jfire.tokenizer import Tokenizer, _bytes_to_unicode


@pytest.fixture(scope="module")
def default_tokenizer(default_checkpoint):
    from jfire.checkpoint.load import load_config_and_tokenizer

    return load_config_and_tokenizer("default")[1]


def test_the_default_tokenizers_longest_token_and_the_bytes_it_drops(default_tokenizer):
    tok = default_tokenizer
    assert tok.max_token_bytes == max(len(tok.token_bytes(i)) for i in range(tok.vocab_size)) == 81
    ascii_dropped = [b for b in tok.dropped_bytes if b < 0x80]
    assert ascii_dropped and all(tok.encode(chr(b) * 3, add_special_tokens=False) == [] for b in ascii_dropped)
    assert tok.encode("\n\t a", add_special_tokens=False)  # the usual control characters are kept


def byte_level(normalizer=None, extra: dict[str, int] | None = None) -> Tokenizer:
    """A byte-level BPE that spells every byte, and `extra` tokens."""
    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    vocab.update({t: len(vocab) + i for i, t in enumerate(extra or {})})
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if normalizer is not None:
        backend.normalizer = normalizer
    return Tokenizer(backend, bos_token=None, eos_token=None, add_bos=False, chat_template=None)


def test_a_byte_level_vocabulary_counts_bytes_not_characters():
    tok = byte_level(extra={"ĠĠĠĠ": 0, "ĠĠé": 0})  # 4 spaces; 2 spaces and byte 0xe9
    assert (tok.max_token_bytes, tok.dropped_bytes) == (4, b"")
    # A normal form can shorten a text (U+1D400 MATHEMATICAL BOLD CAPITAL A, 4 bytes -> "A").
    assert byte_level(normalizers.NFKC()).max_token_bytes == 4 * 1
    assert len(byte_level(normalizers.NFKC()).encode("\U0001d400" * 8, add_special_tokens=False)) == 8


@pytest.mark.parametrize(
    "make",
    [
        # Whitespace goes: a megabyte of spaces is no token at all.
        lambda: tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
        lambda: byte_level(normalizers.Strip()),
        lambda: byte_level(normalizers.Replace(tokenizers.Regex(r"\s+"), " ")),
        # A run of unknown characters fused into one token.
        lambda: tokenizers.Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True)),
    ],
)
def test_tokenizers_that_can_swallow_any_amount_of_text_have_no_bound(make):
    made = make()
    if isinstance(made, tokenizers.Tokenizer):
        if isinstance(made.model, models.WordPiece):
            made.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        made = Tokenizer(made, bos_token=None, eos_token=None, add_bos=False, chat_template=None)
    assert made.max_token_bytes is None


def test_text_limit_refuses_more_bytes_than_the_context_can_hold():
    limit = TextLimit(tokens=9, token_bytes=4, dropped=b"\x04")  # 36 bytes
    limit.check("a" * 36)
    limit.check("a" * 30 + "\x04" * 100)  # dropped bytes are not counted
    with pytest.raises(RequestError) as refused:
        limit.check("é" * 19)  # 38 bytes
    assert str(refused.value) == (
        "the prompt is 38 bytes of text but the context holds at most 36: 9 tokens of at most 4 bytes each; "
        "shorten the prompt"
    )
    assert (refused.value.param, refused.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(RequestError, match=r"is 137 bytes of text \(37 without the bytes the tokenizer drops\)"):
        limit.check("a" * 37 + "\x04" * 100)
