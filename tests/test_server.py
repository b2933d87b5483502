"""`pagedmla serve` as a real process on the loopback interface, driven by the official
`openai` client (and plain HTTP where the client has no call): completions and chat,
streamed against non-streamed, usage, stop strings, n, concurrent clients against
sequential ones, disconnects, bad requests, the API key, and SIGTERM draining."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedmla.models.tiny import write_tiny_checkpoint
from pagedmla.tokenizer import ByteTokenizer
from tests.dist_helpers import free_port

MODEL = "tiny-chat"
KEY = "test-key"
# A chat template in the form transformers renders (jinja2, trim_blocks, lstrip_blocks).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _checkpoint(root: Path) -> Path:
    """The random tiny model with a tokenizer.json and a chat template."""
    path = write_tiny_checkpoint(root)
    ByteTokenizer().to_tokenizers().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": TEMPLATE}))
    return path


class Server:
    def __init__(self, checkpoint: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedmla", "serve", "--model", str(checkpoint),
             "--device", "cpu", "--port", str(self.port), "--served-model-name", MODEL,
             "--block-size", "16", "--num-kv-blocks", "256", "--max-num-seqs", "8",
             "--max-num-batched-tokens", "64", *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the server did not start")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, **kwargs)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        if "{" in name:
            return 0.0  # a labelled series not seen yet
        raise KeyError(name)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def server(checkpoint) -> Iterator[Server]:
    s = Server(checkpoint, "--api-key", KEY)
    yield s
    assert s.stop() == 0


def _complete(client, stream: bool, **kwargs):
    return client.completions.create(model=MODEL, stream=stream, **kwargs)


def test_streamed_completion_equals_the_whole(server) -> None:
    client = server.client()
    args = {"prompt": "The paged latent cache", "max_tokens": 20, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}
    whole = _complete(client, False, **args)
    chunks = list(_complete(client, True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and whole.choices[0].finish_reason == "length"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    prompt_tokens = len(ByteTokenizer().encode(args["prompt"]))
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == 20
    assert whole.usage.total_tokens == prompt_tokens + 20


def test_chat_streamed_equals_the_whole(server) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is MLA?"}]
    args = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    rendered = ("<bos><|system|>\nBe brief.\n<|user|>\nWhat is MLA?\n<|assistant|>\n")
    tokens = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                        json={"messages": messages}).json()
    want = [1, *ByteTokenizer().encode(rendered[len("<bos>"):], add_special_tokens=False)]
    assert tokens["tokens"] == want and whole.usage.prompt_tokens == len(want)


def test_stop_strings_and_n(server) -> None:
    client = server.client()
    base = {"prompt": "Multi-head latent attention", "max_tokens": 24, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}
    full = _complete(client, False, **base).choices[0].text
    stop = full[5:8]
    cut = _complete(client, False, stop=[stop], **base).choices[0]
    assert cut.text == full[:full.find(stop)] and cut.finish_reason == "stop"
    many = _complete(client, False, n=3, **base)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert all(c.text == full for c in many.choices)  # greedy: the same three times
    assert many.usage.completion_tokens == 3 * 24


def test_concurrent_clients_get_the_sequential_outputs(server) -> None:
    client = server.client(timeout=300)
    prompts = [f"request {i}: " + "x" * (i % 7) for i in range(32)]
    args = {"max_tokens": 8, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    sequential = [_complete(client, False, prompt=p, **args).choices[0].text for p in prompts]
    got: dict[int, str] = {}

    def call(i: int) -> None:
        got[i] = _complete(client, False, prompt=prompts[i], **args).choices[0].text

    threads = [threading.Thread(target=call, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [got[i] for i in range(32)] == sequential


def test_a_disconnected_client_aborts_its_request(server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "disconnect", "max_tokens": 3000, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers,
                      timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert server.metric("pagedmla_num_requests_running") == 1
    deadline = time.time() + 30
    while server.metric("pagedmla_num_requests_running") != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("pagedmla_num_requests_running") == 0
    assert server.metric("pagedmla_kv_cache_usage_perc") == 0
    # Aborted, not finished: 3000 tokens take far longer than the wait above.
    assert server.metric('pagedmla_request_success_total{finished_reason="abort"}') >= 1


def test_a_client_that_drops_a_whole_response_request_aborts_it(server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    before = server.metric('pagedmla_request_success_total{finished_reason="abort"}')
    body = {"model": MODEL, "prompt": "drop", "max_tokens": 3000, "temperature": 0.0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=1.0)
    deadline = time.time() + 30
    while server.metric("pagedmla_num_requests_running") != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("pagedmla_num_requests_running") == 0
    assert server.metric('pagedmla_request_success_total{finished_reason="abort"}') > before


def test_logprobs_and_a_chat_without_max_tokens(server) -> None:
    client = server.client()
    whole = _complete(client, False, prompt="logprobs", max_tokens=6, temperature=0.0,
                      logprobs=2, extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    # Greedy: each token's logprob is the largest of its step's top entries (entries are
    # keyed by text, so tokens of the same text share one).
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and value >= max(top.values()) - 1e-6
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0,
            "logprobs": True, "top_logprobs": 3, "max_tokens": 12, "stop": ["zz", "e"],
            "extra_body": {"ignore_eos": True}}
    chat = client.chat.completions.create(**args)
    streamed = list(client.chat.completions.create(stream=True, **args))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == len(chat.choices[0].logprobs.content)
    assert all(len(e.top_logprobs) == 3 for e in entries)
    # No max_tokens: as many as the model and the cache allow (here max_tokens 2 stops it
    # early only through the prompt's length; the request must be accepted).
    free = client.chat.completions.create(model=MODEL, temperature=0.0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          stop=["\n"])
    assert free.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"model": "other", "prompt": "x"}, "model"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, None),  # longer than the model
    ({"model": MODEL, "prompt": [[]]}, None),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"model": MODEL}, "prompt"),
])
def test_bad_requests_get_400_and_the_server_stays_healthy(server, body, param) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_the_api_key_is_demanded(server) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0
                      ).models.list()
    assert [m.id for m in server.client().models.list().data] == [MODEL]


def test_sigterm_drains_the_requests_in_flight(checkpoint) -> None:
    server = Server(checkpoint)
    client = server.client(timeout=120)
    stream = _complete(client, True, prompt="drain", max_tokens=200, temperature=0.0,
                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    server.process.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest[-2].choices[0].finish_reason == "length"
    assert rest[-1].usage.completion_tokens == 200
    assert server.process.wait(60) == 0
