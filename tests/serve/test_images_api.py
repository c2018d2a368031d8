"""Images in chat requests, end to end: a real `jfire serve` of a tiny random Llama 4 with its
vision tower (tests/vision/test_image_prompts.py's) and Llama 4's own chat template, talked to
with the official openai client.

- An image sent as a data URL gives the greedy tokens `jfire generate --image` gives, and
  those of transformers' `generate` on the same prompt: transformers' tokenizer renders the
  chat template, jfire's `expand_prompt` puts in the image's placeholder ids (shown equal to
  transformers' processor in tests/vision), jfire's pixel values go in (shown equal to the
  HF image processor's there).
- The same image served over http (a ThreadingHTTPServer on 127.0.0.1, which the server is
  started to allow with --allow-private-image-urls) gives the same tokens.
- /metrics counts the images, the encoder's time and its cache hits.
- Refusals are 400s naming the field: a corrupt image, too many images, an unreachable URL;
  an image to a text-only model, an http URL with fetching off, an image URL on 127.0.0.1
  without the opt-in (which the server never contacts), image parts in other APIs' shapes or
  outside user messages (at the app level, with stand-in engines); `jfire generate --image` on a
  text-only model (exit status 2).
- The image flags are the loader's limits, and `launch` hands them on to its frontend.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import http.server
import io
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from starlette.testclient import TestClient

from jfire.cli import _image_flags, build_parser, image_limits
from jfire.cli import main as cli_main
from jfire.errors import JfireError
from jfire.tokenizer import Tokenizer
from jfire.vision.images import ImageLimits
from jfire.vision.model import load_vision_model
from jfire.vision.url_policy import UrlPolicy
from serve.app import ServerState, create_app
from tests.serve.server_process import start_server
from tests.tiny_models import COMMON, save_tiny_hf_model
from tests.vision.test_image_prompts import (
    LLAMA4_PREPROCESSOR,
    LLAMA4_TOKENS,
    random_image,
    tiny_llama4_with_vision,
)

TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "transformers-llama4-processing_llama4.jinja"
# Llama 4's chat tokens at the ids the tiny config's BOS and EOS have, and two more; the role
# names as words, so that the template's text is all tokens of the vocabulary.
CHAT_TOKENS = {"<|begin_of_text|>": 1, "<|eot|>": 2, "<|header_start|>": 3, "<|header_end|>": 4}
WORDS = {"user": 5, "assistant": 6, "system": 7}
TEXT = "w17 w42 w99 w120"
MAX_TOKENS = 8
MAX_IMAGES = 2
MODEL = "tiny"


# -- the model and the server ----------------------------------------------------------------------


def save_chat_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the 256 ids: Llama 4's chat and image tokens as special
    tokens, `w{id}` for the rest; BOS, EOS and Llama 4's chat template in tokenizer_config."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    special = CHAT_TOKENS | LLAMA4_TOKENS
    taken = set(special.values()) | set(WORDS.values())
    vocab = special | WORDS | {f"w{i}": i for i in range(COMMON["vocab_size"]) if i not in taken}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(special))
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot|>", chat_template=TEMPLATE.read_text()
    ).save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = tiny_llama4_with_vision()
    path = tmp_path_factory.mktemp("llama4_images")
    model.save_pretrained(path)
    save_chat_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(LLAMA4_PREPROCESSOR))
    return path


@pytest.fixture(scope="module")
def image_png() -> bytes:
    """60 x 100: 2 x 2 tiles and the global tile."""
    out = io.BytesIO()
    random_image(60, 100, seed=1).save(out, format="PNG")
    return out.getvalue()


ENGINE_ARGS = ["--max-batch", "2", "--max-context", "256", "--kv-cache-gb", "0.01", "--quick-compile"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = start_server(
        [
            *("--model", str(model_dir), "--served-model-name", MODEL, *ENGINE_ARGS),
            *("--max-images", str(MAX_IMAGES), "--allow-private-image-urls"),  # image_url_server is on 127.0.0.1
        ],
        tmp_path_factory.mktemp("log") / "serve.log",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@dataclasses.dataclass
class ImageUrlServer:
    url: str  # http://127.0.0.1:PORT
    hits: list[str]  # the path of each GET it was sent


@pytest.fixture(scope="module")
def image_url_server(image_png):
    """http://127.0.0.1:PORT/ serving the image at /image.png, 404 elsewhere."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            if self.path != "/image.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image_png)))
            self.end_headers()
            self.wfile.write(image_png)

        def log_message(self, *args):  # quiet
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield ImageUrlServer(f"http://127.0.0.1:{httpd.server_address[1]}", hits)
    httpd.shutdown()
    httpd.server_close()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_message(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": TEXT}]}]


def chat(client, messages):
    """(prompt ids, generated ids) of a greedy chat completion."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    return r.prompt_token_ids, r.choices[0].token_ids


def refusal(client, messages) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    return caught.value.response.json()["error"]


# -- the references ------------------------------------------------------------------------------


@functools.cache
def transformers_tokens(model_dir: Path, png: bytes) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) of transformers' model on the image and TEXT."""
    from PIL import Image

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    template_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    vision = load_vision_model(model_dir, tokenizer=Tokenizer.from_dir(model_dir))
    pixels = vision.preprocess(Image.open(io.BytesIO(png)).convert("RGB"))
    ids = vision.expand_prompt(list(template_ids), [pixels])
    model = transformers.Llama4ForConditionalGeneration.from_pretrained(model_dir, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: every step counts
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pixel_values=torch.from_numpy(pixels.pixel_values),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return ids, out[0, len(ids) :].tolist()


def jfire_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jfire.cli", "generate", *args], capture_output=True, text=True, timeout=300
    )


# -- the tests -------------------------------------------------------------------------------------


def test_a_data_url_image_gives_the_tokens_of_generate_and_transformers(client, model_dir, image_png, tmp_path):
    prompt_ids, got = chat(client, image_message(data_url(image_png)))
    want_prompt, want = transformers_tokens(model_dir, image_png)
    assert prompt_ids == want_prompt
    assert len(got) == MAX_TOKENS and got == want

    (tmp_path / "image.png").write_bytes(image_png)
    run = jfire_generate("--model", str(model_dir), *ENGINE_ARGS, "--image", str(tmp_path / "image.png"),
                         "--prompt", TEXT, "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    generated = json.loads(run.stdout)
    assert generated["prompt_ids"] == want_prompt and generated["token_ids"] == want


def test_an_http_url_gives_the_same_tokens(client, model_dir, image_png, image_url_server):
    prompt_ids, got = chat(client, image_message(image_url_server.url + "/image.png"))
    assert (prompt_ids, got) == transformers_tokens(model_dir, image_png)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {
        name: float(value) for name, value in (line.split() for line in text.splitlines() if line.startswith("jfire_"))
    }


def test_metrics_count_images_and_encoder_cache_hits(server, client, image_png):
    before = metrics(server)
    # The same image after different text: no prefix in common, so the second prompt needs the
    # image's rows again, and finds them in the encoder cache.
    for lead in ("w9", "w10"):
        messages = image_message(data_url(image_png))
        messages[0]["content"].insert(0, {"type": "text", "text": lead})
        chat(client, messages)
    after = metrics(server)
    assert after["jfire_images_total"] - before.get("jfire_images_total", 0) == 2
    assert after["jfire_encoder_cache_hits_total"] - before.get("jfire_encoder_cache_hits_total", 0) >= 1
    assert after["jfire_encoder_seconds_total"] > 0


def test_bad_images_are_400s_naming_the_field(client, image_png, image_url_server):
    corrupt = data_url(image_png[:40] + bytes(len(image_png) - 40))
    error = refusal(client, image_message(data_url(image_png), corrupt))
    assert (error["param"], error["code"]) == ("messages.0.content.1.image_url.url", "invalid_image"), error

    urls = [data_url(image_png)] * (MAX_IMAGES + 1)
    error = refusal(client, image_message(*urls))
    assert (error["param"], error["code"]) == (f"messages.0.content.{MAX_IMAGES}.image_url.url", "too_many_images")
    assert f"at most {MAX_IMAGES}" in error["message"]

    error = refusal(client, image_message(image_url_server.url + "/missing.png"))
    assert error["param"] == "messages.0.content.0.image_url.url" and "404" in error["message"], error
    # The server is none the worse: the next request is served.
    assert len(chat(client, image_message(data_url(image_png)))[1]) == MAX_TOKENS


# -- refusals that need no model: the app with stand-in engines -------------------------------------


class StandInEngine:
    """An EngineClient answering what the app asks before a request reaches an engine."""

    tokenizer, vocab_size, model_type, max_model_len = None, 256, None, 256
    error = on_fatal = None

    def is_ready(self):
        return True

    def health(self):
        return 200, {"status": "ok"}

    def stats(self):
        return {}


class TextOnlyEngine(StandInEngine):
    vision = None


class VisionEngine(StandInEngine):
    vision = object()  # the refusals sent to it come before any image is preprocessed


def post_chat(engine, content, role: str = "user", limits: ImageLimits | None = None) -> httpx.Response:
    state = ServerState(engine=engine, model_name=MODEL, access_log=False)
    if limits is not None:
        state.image_limits = limits
    messages = [{"role": "system", "content": "be brief"}, {"role": role, "content": content}]
    return TestClient(create_app(state)).post("/v1/chat/completions", json={"model": MODEL, "messages": messages})


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}


def test_an_image_to_a_text_only_model_is_a_400_naming_the_part():
    error = error_of(post_chat(TextOnlyEngine(), [{"type": "text", "text": "what is it?"}, IMAGE_PART]))
    assert (error["param"], error["code"]) == ("messages.1.content.1", "images_not_supported")
    assert "this model" in error["message"] and "takes no images" in error["message"]


def test_image_urls_are_refused_when_fetching_is_off():
    part = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/image.png"}}
    error = error_of(post_chat(VisionEngine(), [part], limits=ImageLimits(fetch_urls=False)))
    assert (error["param"], error["code"]) == ("messages.1.content.0.image_url.url", "image_fetch_disabled")
    assert "data URL" in error["message"]


def test_image_urls_to_internal_addresses_are_refused_unless_allowed(image_url_server):
    """By default the server never contacts 127.0.0.1: a 400 that says no more than an
    unreachable host would, and the image server sees no request."""
    part = {"type": "image_url", "image_url": {"url": image_url_server.url + "/image.png"}}
    before = len(image_url_server.hits)
    error = error_of(post_chat(VisionEngine(), [part]))
    assert (error["param"], error["code"]) == ("messages.1.content.0.image_url.url", "image_fetch_failed")
    assert error["message"].startswith(f"could not fetch the image at {image_url_server.url}/image.png: ")
    assert "cannot reach that host or does not fetch from it" in error["message"]
    assert len(image_url_server.hits) == before


@pytest.mark.parametrize(
    ("content", "role", "param", "words"),
    [
        ([IMAGE_PART], "assistant", "messages.1.content", "user messages only"),
        ([{"type": "input_image", "image_url": "x"}], "user", "messages.1.content.0", "Responses API"),
        ([{"type": "image"}], "user", "messages.1.content.0", '"image_url"'),
        ([{"type": "audio"}], "user", "messages.1.content.0", "'audio' are not taken"),
        ([{"type": "image_url", "image_url": {"url": 5}}], "user", "messages.1.content.0.image_url.url", "string"),
        ([{"type": "image_url", "image_url": {"url": "x", "detail": "max"}}], "user",
         "messages.1.content.0.image_url.detail", "'auto', 'low' or 'high'"),
        ([{"type": "image_url"}], "user", "messages.1.content.0.image_url", "missing"),
    ],
)  # fmt: skip
def test_image_parts_in_other_shapes_are_400s_naming_the_field(content, role, param, words):
    error = error_of(post_chat(VisionEngine(), content, role=role))
    assert error["param"] == param and words in error["message"], error


def test_generate_refuses_an_image_for_a_text_only_model(tmp_path, capsys):
    """In this process (jfire.cli.main): each refusal comes before anything is compiled."""
    model = str(save_tiny_hf_model("llama3", tmp_path / "llama"))
    image = tmp_path / "image.png"
    random_image(20, 30, seed=3).save(image)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(20))
    for args, words in [
        (["--image", str(image), "--prompt-ids", "1,2"], "--image goes with --prompt or --chat"),
        (["--image", str(tmp_path / "broken.png"), "--prompt", "hi"], f"--image {tmp_path / 'broken.png'}: "),
        (["--image", str(image), "--prompt", "hi", "--kv-cache-gb", "0.01"], "this model takes no images"),
    ]:
        assert cli_main(["generate", "--model", model, *args]) == 2
        assert words in capsys.readouterr().err


def test_serve_flags_are_the_image_limits():
    def limits(*flags):
        return image_limits(build_parser().parse_args(["serve", *flags]))

    assert limits() == ImageLimits()  # the flags' defaults are the loader's
    assert limits("--max-images", "3", "--max-image-mb", "0.5", "--max-image-pixels", "1000",
                  "--image-fetch-timeout", "2.5", "--no-image-urls") == ImageLimits(
        max_images=3, max_bytes=1 << 19, max_pixels=1000, fetch_timeout_s=2.5, fetch_urls=False)  # fmt: skip
    assert limits("--allowed-image-domains", "Example.com, images.test.", "--allow-private-image-urls") == ImageLimits(
        url_policy=UrlPolicy(allowed_domains=("example.com", "images.test"), allow_private=True))  # fmt: skip
    with pytest.raises(JfireError, match="--max-images must be > 0"):
        limits("--max-images", "0")
    with pytest.raises(JfireError, match="--allowed-image-domains: .*'https://example.com'"):
        limits("--allowed-image-domains", "https://example.com")


def test_launch_hands_its_image_flags_to_the_frontend():
    """`launch` passes the flags it was given on to its frontend process, which parses them as
    serve would: the frontend's limits are the ones asked for."""
    flags = ["--max-images", "3", "--no-image-urls", "--allowed-image-domains", "cdn.example.com,10.1.2.3",
             "--allow-private-image-urls"]  # fmt: skip
    launch_args = build_parser().parse_args(["launch", "local-1p1d", *flags])
    frontend_args = build_parser().parse_args(["launch", "local-1p1d", *_image_flags(launch_args)])
    assert image_limits(frontend_args) == image_limits(build_parser().parse_args(["serve", *flags]))
    assert image_limits(frontend_args).url_policy == UrlPolicy(("cdn.example.com", "10.1.2.3"), allow_private=True)
    default = build_parser().parse_args(["launch", "local-1p1d"])
    assert _image_flags(default) == () and image_limits(default) == ImageLimits()
