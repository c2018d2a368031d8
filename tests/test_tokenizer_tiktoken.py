"""jfire.tokenizer on a Kimi K2-style directory (tiktoken.model + tokenizer_config.json).

The references, each built here on its own: a `tiktoken.Encoding` assembled as upstream's
tokenization_kimi.py assembles it; transformers' TikTokenConverter (the Rust `tokenizers` BPE
and Oniguruma's regex) given Kimi's pattern; and a pure-Python split (`regex`, V1 for the `&&`
class intersections) with tiktoken's educational BPE. The vocabulary is trained here, on a
small multilingual text, by tiktoken's educational trainer.
"""

import base64
import json
import random
from pathlib import Path

import pytest
import regex
import tiktoken
from tiktoken._educational import bpe_encode, bpe_train
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from jfire.tiktoken_bpe import KIMI_PATTERN
from jfire.tokenizer import Tokenizer, TokenizerError

# Verbatim from upstream's tokenization_kimi.py (Kimi K2).
UPSTREAM_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED = 256

CORPUS = """The quick brown fox jumps over the lazy dog. HelloWorld and CamelCaseNames, I'M here, they'll say it's fine.
我们的模型使用中文分词，这是一个测试。中文文本和日本語のテキスト、ひらがなとカタカナ。
def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n
Numbers 12345 678,90 3.14159 2024-06-01 and    spaces\t\ttabs\r\nwindows lines\n\n\n
Русский текст и ελληνικά. naïve café résumé Ünïcödé 🙂🚀 emoji 👨‍👩‍👧‍👦
"""
N_MERGES = 300

# Offsets from the rank count, laid out as in Kimi K2's tokenizer_config.json; the gaps are
# upstream's `<|reserved_token_{id}|>`. `<think>` is an added token flagged not special.
NAMED = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    17: "<|im_middle|>",
    22: "<think>",
    254: "[UNK]",
    255: "[PAD]",
}
NOT_SPECIAL = {"<think>"}

TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

TEXTS = [
    "",
    "Hello, world!",
    "HelloWorld CamelCaseNames ALLCAPS lowerUPPER",
    "I'm sure they'll say it's fine; I'M HERE, you'RE there",
    " it's",  # one piece for Kimi's split; cl100k's (transformers' default for tiktoken.model) cuts "'s"
    "我们的模型使用中文分词，这是一个测试。",
    "中文abc日本語のテキスト한국어 텍스트 中a文",
    "naïve café résumé Ünïcödé a\u0301b",
    "emoji 🙂🚀 and family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "12345 678,90 3.14159 1e-9 2024-06-01 1234567890",
    "  leading spaces and trailing spaces   ",
    "tabs\tand\t\ttabs \n\n   \n \t \nline\r\nwindows",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "Русский текст и ελληνικά και العربية",
    "<|im_user|>user<|im_middle|>hi 中文<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]text[EOS] <think>plan</think> [UNK][PAD]",
    "<|im_user <|im_end| |> [BOS",
    "x" * 300,
    "mixed\u00a0nbsp\u2003em-space\u200bzero-width",
]


def _train_ranks() -> dict[bytes, int]:
    trained = bpe_train(CORPUS, 256 + N_MERGES, "(?V1)" + UPSTREAM_PATTERN, visualise=None)
    merged = sorted((t for t in trained if len(t) > 1), key=trained.__getitem__)
    # Real rank files interleave single bytes with merges; merge order is what must be kept.
    rng = random.Random(0)
    order = list(merged)
    for b in rng.sample(range(256), 256):
        order.insert(rng.randint(0, len(order)), bytes([b]))
    return {t: i for i, t in enumerate(order)}


RANKS = _train_ranks()
N_BASE = len(RANKS)


def _write_rank_file(path: Path, ranks: dict[bytes, int]) -> None:
    # Written by hand (not through jfire) in upstream's format, shuffled: ranks, not lines, order it.
    lines = [f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()]
    random.Random(1).shuffle(lines)
    path.write_text("".join(lines))


def _kimi_config(*, template_in_config: bool) -> dict:
    config = {
        "added_tokens_decoder": {
            str(N_BASE + off): {
                "content": name, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": name not in NOT_SPECIAL,
            }
            for off, name in NAMED.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    if template_in_config:
        config["chat_template"] = TEMPLATE
    return config


def _write_kimi_dir(path: Path, *, template_in_config: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    _write_rank_file(path / "tiktoken.model", RANKS)
    (path / "tokenizer_config.json").write_text(json.dumps(_kimi_config(template_in_config=template_in_config)))
    if not template_in_config:
        (path / "chat_template.jinja").write_text(TEMPLATE)
    # Kimi ends a turn with <|im_end|>: generation_config names it.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": N_BASE + 2}))
    return path


def _special_names() -> list[str]:
    return [NAMED.get(i - N_BASE, f"<|reserved_token_{i}|>") for i in range(N_BASE, N_BASE + NUM_RESERVED)]


@pytest.fixture(scope="module", autouse=True)
def _no_tiktoken_cache():
    # tiktoken's loader (the references use it) caches files by path under /tmp unless this is "".
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        yield


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    return _write_kimi_dir(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def ours(kimi_dir) -> Tokenizer:
    return Tokenizer.from_dir(kimi_dir)


@pytest.fixture(scope="module")
def upstream(kimi_dir) -> "tiktoken.Encoding":
    # As tokenization_kimi.py builds it: tiktoken's own loader, specials from the rank count on.
    ranks = load_tiktoken_bpe(str(kimi_dir / "tiktoken.model"))
    specials = {name: len(ranks) + k for k, name in enumerate(_special_names())}
    return tiktoken.Encoding("kimi", pat_str=UPSTREAM_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def hf(kimi_dir) -> PreTrainedTokenizerFast:
    converted = TikTokenConverter(
        vocab_file=str(kimi_dir / "tiktoken.model"), pattern=UPSTREAM_PATTERN, extra_special_tokens=_special_names()
    ).converted()
    return PreTrainedTokenizerFast(
        tokenizer_object=converted, bos_token="[BOS]", eos_token="[EOS]", chat_template=TEMPLATE
    )


def _educational(text: str) -> list[int]:
    """Pure-Python reference for text without special tokens."""
    ids = []
    for piece in regex.findall("(?V1)" + UPSTREAM_PATTERN, text):
        ids.extend(bpe_encode(RANKS, piece.encode("utf-8"), visualise=None))
    return ids


def _fuzz_texts(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pieces = [" ", "  ", "\n", "\r\n", "\t", "a", "Z", "Hello", "World", "é", "ß", "1", "42", "'s", "'LL",
              "中", "文", "の", "カ", "🙂", "\u200d", "\u0301", ".", "!?", "<|im_end|>", "[BOS]", "<|", "_"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 24))) for _ in range(n)]


# ---- facts -----------------------------------------------------------------------------


def test_pattern_is_upstreams():
    assert KIMI_PATTERN == UPSTREAM_PATTERN


def test_facts(ours, upstream):
    assert ours.vocab_size == upstream.n_vocab == N_BASE + NUM_RESERVED
    assert ours.bos_id == N_BASE and ours.bos_token == "[BOS]"
    assert ours.eos_ids == frozenset({N_BASE + 1, N_BASE + 2})
    assert ours.add_bos is False
    assert ours.chat_template == TEMPLATE


def test_special_tokens_map_to_their_ids(ours, upstream):
    for k, name in enumerate(_special_names()):
        assert ours.encode(name) == [N_BASE + k] == upstream.encode(name, allowed_special="all"), name
        assert ours.backend.token_to_id(name) == N_BASE + k
    assert _special_names()[5] == f"<|reserved_token_{N_BASE + 5}|>"
    ids = ours.encode("[BOS]hi<think>x<|im_end|>")
    assert ids[0] == N_BASE and ids[-1] == N_BASE + 2
    assert ours.decode(ids, skip_special_tokens=False) == "[BOS]hi<think>x<|im_end|>"
    # Skipping drops specials but keeps an added token flagged "special": false.
    assert ours.decode(ids, skip_special_tokens=True) == "hi<think>x"


# ---- encode / decode -------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_references(ours, upstream, hf, text):
    ids = ours.encode(text)
    assert ids == upstream.encode(text, allowed_special="all")
    assert ids == hf.encode(text, add_special_tokens=False)
    if not any(name in text for name in _special_names()):
        assert ids == _educational(text)
    assert ours.encode(text, add_special_tokens=False) == ids  # no BOS: add_bos is off
    assert ours.decode(ids, skip_special_tokens=False) == text == hf.decode(ids, skip_special_tokens=False)


def test_encode_fuzz_matches_references(ours, upstream, hf):
    for text in _fuzz_texts():
        ids = ours.encode(text)
        assert ids == upstream.encode(text, allowed_special="all") == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text


def _upstream_cuts(s: str, limit: int) -> list[str]:
    # tokenization_kimi.py's _split_whitespaces_or_nonwhitespaces, restated.
    out, start, run, is_space = [], 0, 0, s[0].isspace() if s else False
    for i, ch in enumerate(s):
        if ch.isspace() != is_space:
            run, is_space = 1, ch.isspace()
        else:
            run += 1
            if run > limit:
                out.append(s[start:i])
                start, run = i, 1
    out.append(s[start:])
    return out


@pytest.mark.parametrize(
    "text, n_cuts",
    [
        ("ab " + "x" * 25_003 + " " * 25_002 + "yz 中" * 3, 2),
        ("\n\n " * 20_000 + "a", 2),  # one whitespace run of 60k: cut at 25k and 50k
        ("中" * 25_000 + " " + "中" * 25_000, 0),  # runs of exactly the limit stay whole
        (" quick" * 75_000, 1),  # 450k characters: tiktoken's 400k limit, no long runs
    ],
)
def test_long_runs_are_cut_like_upstream(ours, upstream, text, n_cuts):
    cuts = [p for i in range(0, len(text), 400_000) for p in _upstream_cuts(text[i : i + 400_000], 25_000)]
    assert len(cuts) == n_cuts + 1
    expected = [i for piece in cuts for i in upstream.encode(piece, allowed_special="all")]
    # The cuts show in the ids, so this tells cut from uncut.
    assert (expected != upstream.encode(text, allowed_special="all")) == (n_cuts > 0)
    assert ours.encode(text) == expected
    assert ours.decode(expected) == text


# ---- chat ------------------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are Kimi."},
        {"role": "user", "content": "你好！Tell me a joke about 🐍 and 42."},
        {"role": "assistant", "content": "HelloWorld!"},
        {"role": "user", "content": "again"},
    ],
]


@pytest.mark.parametrize("template_in_config", [True, False], ids=["config", "jinja-file"])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
def test_chat_template_matches_transformers(hf, tmp_path, template_in_config, gen):
    tok = Tokenizer.from_dir(_write_kimi_dir(tmp_path, template_in_config=template_in_config))
    for chat in CHATS:
        text = tok.render_chat(chat, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        ids = tok.encode_chat(chat, add_generation_prompt=gen)
        expected = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
        assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert ids[0] == (N_BASE + 10 if chat[0]["role"] == "system" else N_BASE + 3)
        assert tok.decode(ids, skip_special_tokens=False) == text


# ---- streaming -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld 🙂🚀 中文分词 👨‍👩‍👧‍👦 done",
        "<|im_assistant|>assistant<|im_middle|>ñ 🇫🇷 日本語のテキスト<|im_end|>",
        "plain ascii text",
    ],
)
@pytest.mark.parametrize("skip", [True, False])
def test_stream_decoder_concatenates_to_full_decode(ours, text, skip):
    ids = ours.encode(text)
    stream = ours.stream_decoder(skip_special_tokens=skip)
    parts = [stream.push(i) for i in ids]
    parts.append(stream.flush())
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == ours.decode(ids, skip_special_tokens=skip)
    if "🙂" in text:
        # The vocabulary has tokens that end inside a character (b'\xf0\x9f'), so pushes hold back.
        assert any("\ufffd" in ours.decode([i]) for i in ids)
        assert "" in parts[:-1]


def test_stream_decoder_flushes_incomplete_bytes(ours):
    ids = ours.encode("🙂")
    assert len(ids) > 1
    stream = ours.stream_decoder()
    assert stream.push(ids[0]) == ""
    assert stream.flush() == ours.decode(ids[:1]) == "\ufffd"


# ---- saving (what `jfire convert` writes) ----------------------------------------------


def test_save_round_trips(ours, tmp_path):
    ours.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiktoken.model", "tokenizer_config.json"]
    back = Tokenizer.from_dir(tmp_path)
    assert (back.vocab_size, back.bos_id, back.eos_ids, back.add_bos, back.chat_template) == (
        ours.vocab_size, ours.bos_id, ours.eos_ids, ours.add_bos, ours.chat_template
    )
    for text in TEXTS:
        assert back.encode(text) == ours.encode(text)
        ids = ours.encode(text)
        assert back.decode(ids) == ours.decode(ids)


# ---- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, match",
    [
        ("not*base64 12\n", r"line 3: expected 'base64-token rank'"),
        ("AAECAw==\n", r"line 3: expected 'base64-token rank' \(1 fields\)"),
        ("AAECAw== twelve\n", r"line 3: expected 'base64-token rank'"),
        ("AAECAw== -4\n", r"line 3: expected 'base64-token rank' \(negative rank\)"),
        ("AAECAw== 1\n", r"line 3: rank 1 already given on line 2"),
        ("{first} 999999\n", r"line 3: token b'.*' already has rank 0"),
    ],
)
def test_malformed_rank_file_names_file_and_line(tmp_path, line, match):
    in_order = sorted(RANKS, key=RANKS.__getitem__)
    lines = [f"{base64.b64encode(t).decode()} {RANKS[t]}\n" for t in in_order]
    lines.insert(2, line.format(first=base64.b64encode(in_order[0]).decode()))
    (tmp_path / "tiktoken.model").write_text("".join(lines))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(_kimi_config(template_in_config=True)))
    with pytest.raises(TokenizerError, match=match) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tiktoken.model") in str(info.value)


def test_rank_file_gaps_and_missing_bytes(tmp_path):
    path = tmp_path / "tiktoken.model"
    gap = {t: (r + 1 if r >= 10 else r) for t, r in RANKS.items()}
    _write_rank_file(path, gap)
    with pytest.raises(TokenizerError, match="no token has rank 10"):
        Tokenizer.from_dir(tmp_path)
    no_a = {t: r for t, r in sorted(RANKS.items(), key=lambda x: x[1]) if t != b"A" and b"A" not in t}
    _write_rank_file(path, {t: i for i, t in enumerate(no_a)})
    with pytest.raises(TokenizerError, match=r"single bytes \[65\] have no rank"):
        Tokenizer.from_dir(tmp_path)


def test_bad_config_and_ids(ours, tmp_path):
    _write_kimi_dir(tmp_path)
    config = _kimi_config(template_in_config=True)
    config["added_tokens_decoder"][str(N_BASE + 30)] = {"content": "[EOS]", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=rf"'\[EOS\]' names both id {N_BASE + 1} and id {N_BASE + 30}"):
        Tokenizer.from_dir(tmp_path)
    config = _kimi_config(template_in_config=True) | {"eos_token": "[NOPE]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="eos token '\\[NOPE\\]' is not in the vocabulary"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match=rf"token id {N_BASE + NUM_RESERVED} is outside the vocabulary"):
        ours.decode([1, N_BASE + NUM_RESERVED])
