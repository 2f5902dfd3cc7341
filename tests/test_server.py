"""The OpenAI-compatible server, on the default model, started with uvicorn on loopback and exercised with the
official `openai` client and with raw HTTP (urllib)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from early_exit_router import EarlyExitRouter  # noqa: E402
from early_exit_router.decode.loop import Decoder  # noqa: E402
from early_exit_router.integrations.server.app import ServerSettings, create_app  # noqa: E402
from early_exit_router.integrations.server.loadtest import running_server as serving  # noqa: E402
from early_exit_router.integrations.server.text import TextTracker  # noqa: E402

from .conftest import NEVER_EXIT, tiny_llama, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def smol():
    return EarlyExitRouter.from_pretrained(MODEL)


@contextmanager
def running_server(router, **settings):
    """The server on a free loopback port (the load test's helper); yields its base URL and the app."""
    app = create_app(router, ServerSettings(**{"model_name": MODEL, **settings}))
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def server(smol):
    with running_server(smol) as (url, app):
        yield url, app


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def post(url: str, path: str, body, headers: dict | None = None) -> tuple[int, dict, Any]:
    """Raw HTTP POST: (status, JSON body, headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def get(url: str, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return response.status, response.read().decode()


def alone(router, prompt: str, max_tokens: int, chat: bool = False) -> str:
    """The same greedy verify-mode request run directly, alone."""
    ids = router.encode(prompt, chat=chat)
    out = router.generate(ids, max_tokens, mode="verify")
    return router.tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)


def test_models_health_and_metrics(server):
    url, _ = server
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, text = get(url, "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"
    status, text = get(url, "/metrics")
    assert status == 200
    names = ("eer_queue_depth", "eer_requests_total", "eer_tokens_per_second", "eer_hit_rate", "eer_plain_share")
    for name in names + ("eer_exit_agreement", "eer_draft_acceptance"):
        assert name in text
    assert "eer_agreement" not in text  # quality and speed are separate numbers


def test_completion_equals_the_same_request_run_alone(server, smol):
    url, _ = server
    prompt = "The days of the week are Monday, Tuesday,"
    response = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert response.choices[0].text == alone(smol, prompt, 24)
    assert response.usage.completion_tokens == 24 and response.choices[0].finish_reason == "length"
    block = response.model_extra["early_exit"]
    assert block["mode"] == "verify" and "agreement" not in block
    # verify mode: nothing early stays unverified (no exit agreement); the drafts' acceptance is the speed number
    assert block["exit_agreement"] is None and block["exit_checked"] == 0
    assert block["drafts_judged"] > 0 and 0 <= block["draft_acceptance"] <= 1


def test_chat_stream_reassembles_to_the_non_streamed_text(server, smol):
    url, _ = server
    messages = [{"role": "user", "content": "List three colours."}]
    c = client(url)
    full = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    text = full.choices[0].message.content
    assert text == alone(smol, "List three colours.", 30, chat=True)
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(pieces) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])  # null until the last chunk


def test_chat_content_parts_are_read_one_per_line_as_vllm_joins_them(server, smol):
    url, _ = server
    parts = [{"type": "text", "text": "List three"}, {"type": "text", "text": "colours."}]
    messages = [{"role": "user", "content": parts}]
    full = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert full.choices[0].message.content == alone(smol, "List three\ncolours.", 20, chat=True)


def test_per_request_routing_options(server):
    url, _ = server
    c = client(url)
    response = c.completions.create(
        model=MODEL,
        prompt="1, 2, 3, 4,",
        max_tokens=12,
        temperature=0,
        extra_body={"early_exit": {"mode": "exit", "high_conf_threshold": 0.9}},
    )
    block = response.model_extra["early_exit"]
    assert block["mode"] == "exit" and block["exit_checked"] >= 0
    assert block["exit_agreement"] is None or 0 <= block["exit_agreement"] <= 1
    assert block["released_unchecked"] == 0 and block["repaired_tokens"] >= 0  # the default holdback: none unchecked
    status, body, _ = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "early_exit": {"exit_layers": [1]}})
    assert status == 400 and "exit_layers" in body["error"]["message"]
    status, body, _ = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "early_exit": {"holdback": -1}})
    assert status == 400 and "holdback" in body["error"]["message"]


def test_concurrent_streaming_clients_get_their_own_text(server, smol):
    url, _ = server
    prompts = ["Name a fruit.", "Count to five.", "Say hello in French.", "What is 2+2?"]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            stream = client(url).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompts[i]}],
                max_tokens=20,
                temperature=0,
                stream=True,
            )
            results[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except BaseException as error:  # reported below, in the main thread
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    for i, prompt in enumerate(prompts):  # every request got its own answer: nothing lost, duplicated or mixed
        assert results[i] == alone(smol, prompt, 20, chat=True), prompt
    assert server[1].state.scheduler.stats.requests_batched >= 2  # greedy requests shared a batch


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, smol):
    url, _ = server
    status, body, _ = post(url, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body, _ = post(url, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body, _ = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 5})
    assert status == 400 and body["error"]["param"] == "temperature"
    status, body, _ = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2})
    assert status == 400 and "n" in body["error"]["message"]
    status, body, _ = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": 5}})
    assert status == 400 and "logit_bias" in body["error"]["message"]
    long_prompt = "word " * 9000
    status, body, _ = post(url, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 10})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body, _ = post(
        url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]}
    )
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"  # no max_tokens: no room left
    status, body, _ = post(url, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400
    with pytest.raises(openai.BadRequestError):
        client(url).completions.create(model=MODEL, prompt="hi", max_tokens=0)
    response = client(url).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert response.choices[0].text == alone(smol, "Hello", 4)


def test_fields_that_ask_for_nothing_pass_and_the_rest_are_named(server, smol):
    """SDKs send unimplemented fields as null or at their default: those pass. `logprobs: 0` asks for the chosen
    tokens' log-probabilities, which this server does not give: refused, not ignored. A temperature too small to
    divide by decodes greedily, as in vLLM."""
    url, _ = server
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    nothing = {"logit_bias": None, "best_of": 1, "response_format": {"type": "text"}, "suffix": None, "tools": []}
    status, answer, _ = post(url, "/v1/completions", {**body, **nothing})
    assert status == 200 and answer["choices"][0]["text"] == alone(smol, "Hello", 4)
    neutral = {"repetition_penalty": 1.0, "top_k": -1, "min_p": 0.0, "store": False, "parallel_tool_calls": True}
    status, answer, _ = post(url, "/v1/completions", {**body, **neutral})  # vLLM's extras at their neutral values
    assert status == 200 and answer["choices"][0]["text"] == alone(smol, "Hello", 4)
    status, answer, _ = post(url, "/v1/completions", {**body, "max_tokens": None})  # OpenAI's default for completions
    assert status == 200 and answer["choices"][0]["text"] == alone(smol, "Hello", 16)
    defaults = dict.fromkeys(("top_p", "n", "stream", "presence_penalty", "frequency_penalty", "echo"))
    status, answer, _ = post(url, "/v1/completions", {**body, **defaults})  # OpenAI's "or null": the default
    assert status == 200 and answer["choices"][0]["text"] == alone(smol, "Hello", 4)
    status, answer, _ = post(url, "/v1/completions", {**body, "temperature": None, "seed": 3})  # 1.0: it samples
    assert status == 200, answer
    refused = [("logprobs", 0), ("best_of", 2), ("response_format", {"type": "json_object"}), ("top_k", 5)]
    refused += [("best_of", True), ("repetition_penalty", 1.2), ("store", True)]
    for field, value in refused:
        status, answer, _ = post(url, "/v1/completions", {**body, field: value})
        assert status == 400 and field in answer["error"]["message"], field
    status, answer, _ = post(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert status == 400 and "stream is true" in answer["error"]["message"]  # as vLLM refuses it
    status, answer, _ = post(url, "/v1/completions", {**body, "temperature": 1e-40, "seed": 3})
    assert status == 200 and answer["choices"][0]["text"] == alone(smol, "Hello", 4)


def test_a_chat_template_that_refuses_the_messages_answers_400():
    """A template's raise_exception (roles that do not alternate, a system turn it has no place for) is the
    request's fault: a 400 with the template's words, as vLLM answers, not a 500 the client would retry."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "w2 {{ m['content'] }} w3 {% endfor %}w4"
    )
    router = EarlyExitRouter.from_model(tiny_llama(0), tokenizer, exit_layers=[1, 3], **NEVER_EXIT)
    with running_server(router, model_name="tiny") as (url, _):
        twice = [{"role": "user", "content": "w5"}, {"role": "user", "content": "w6"}]
        status, answer, _ = post(url, "/v1/chat/completions", {"model": "tiny", "messages": twice, "max_tokens": 2})
        assert status == 400 and "must alternate" in answer["error"]["message"]
        assert answer["error"]["param"] == "messages"
        status, _, _ = post(url, "/v1/chat/completions", {"model": "tiny", "messages": twice[:1], "max_tokens": 2})
        assert status == 200


def test_overload_answers_503_with_retry_after(smol):
    with running_server(smol, max_queue=1, max_running=1) as (url, _):
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0}
        statuses: list[tuple[int, dict]] = []

        def one() -> None:
            status, _, headers = post(url, "/v1/completions", body)
            statuses.append((status, headers))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(300)
        codes = sorted(s for s, _ in statuses)
        assert codes.count(200) >= 1 and 503 in codes  # one runs, one may wait, the rest are turned away
        assert all(h.get("Retry-After") == "1" for s, h in statuses if s == 503)
        response = client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        assert response.usage.completion_tokens == 3  # and it serves again once the queue drains


ALONE = {"early_exit": {"mode": "exit", "high_conf_threshold": 1.0}}  # routing options of its own: run alone


@pytest.mark.parametrize(
    "temperature, extra", [(0.0, {}), (1.0, {}), (1.0, ALONE)], ids=["batched greedy", "batched sampling", "alone"]
)
def test_a_disconnect_cancels_the_request(smol, temperature, extra):
    with running_server(smol) as (url, app):
        scheduler = app.state.scheduler
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True, **extra}
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps({**body, "temperature": temperature}).encode(),
            headers={"Content-Type": "application/json"},
        )
        response = urllib.request.urlopen(request, timeout=60)
        assert response.readline()  # the stream started
        response.close()  # the client goes away
        deadline = time.time() + 30
        while scheduler.running or scheduler.stats.requests_cancelled == 0:
            assert time.time() < deadline, "the request kept running after the client left"
            time.sleep(0.1)
        assert scheduler.stats.requests_finished == 0  # stopped long before its 400 tokens


def test_a_disconnect_cancels_a_request_that_is_not_streamed(monkeypatch):
    """A non-streamed request finds its client gone while its decode sends it text at every step."""
    step = Decoder.step

    def paced(self: Decoder) -> None:
        time.sleep(0.05)  # steady steps, their events never 0.25 s apart
        step(self)

    monkeypatch.setattr(Decoder, "step", paced)
    router = EarlyExitRouter.from_model(tiny_llama(0), tiny_tokenizer(), exit_layers=[1, 3], **NEVER_EXIT)
    with running_server(router, model_name="tiny") as (url, app):
        scheduler = app.state.scheduler
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"model": "tiny", "prompt": "w5 w17 w33", "max_tokens": 400, "temperature": 0}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        deadline = time.time() + 30
        while not scheduler.running:
            assert time.time() < deadline, "the request never started"
            time.sleep(0.02)
        time.sleep(1.0)  # decoding, some 20 steps
        connection.sock.shutdown(socket.SHUT_RDWR)  # the client goes away
        connection.close()
        while scheduler.running or scheduler.stats.requests_cancelled == 0:
            assert time.time() < deadline, "the request kept running after the client left"
            time.sleep(0.1)
        assert scheduler.stats.requests_finished == 0  # stopped long before its 400 tokens


def test_requests_whose_clients_left_give_their_places_in_the_queue_up(monkeypatch):
    """Queued requests whose clients went away turn no live request away: the worker drops them at its next step,
    not once a slot frees for them."""
    from early_exit_router.decode.sampling import SamplingParams
    from early_exit_router.integrations.server.scheduler import Job, QueueFull, Scheduler

    step = Decoder.step
    monkeypatch.setattr(Decoder, "step", lambda self: (time.sleep(0.02), step(self))[1])
    router = EarlyExitRouter.from_model(tiny_llama(0), tiny_tokenizer(), exit_layers=[1, 3], **NEVER_EXIT)
    scheduler = Scheduler(router, max_queue=2, max_running=1)
    jobs = [Job(torch.tensor([[5, 17, 33]]), 400, "verify", router.config, SamplingParams()) for _ in range(5)]
    running, first, second, refused, live = jobs
    deadline = time.time() + 30
    try:
        scheduler.submit(running)
        while not scheduler.running:
            assert time.time() < deadline, "the first request never started"
            time.sleep(0.01)
        scheduler.submit(first)
        scheduler.submit(second)
        with pytest.raises(QueueFull):
            scheduler.submit(refused)
        first.cancel()
        second.cancel()  # their clients left; the running request still holds the only slot
        while scheduler.queue_depth:
            assert time.time() < deadline, "requests nobody reads still hold the queue"
            time.sleep(0.01)
        assert scheduler.stats.requests_finished == 0, "the queue emptied only once the slot was free"
        scheduler.submit(live)
        assert scheduler.stats.requests_cancelled == 2 and scheduler.running == 1
    finally:
        for job in jobs:
            job.cancel()
        scheduler.shutdown()


def test_sampled_verify_requests_share_a_per_row_batch(smol):
    """Verify-mode sampling runs per row (each row keeps the full model's distribution), so sampled requests join
    the running batch like greedy ones."""
    with running_server(smol) as (url, app):
        texts: list[str] = []

        def one(i: int) -> None:
            messages = [{"role": "user", "content": f"Tell me about the number {i}."}]
            response = client(url).chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0.8
            )
            texts.append(response.choices[0].message.content)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(texts) == 3 and all(texts)
        assert app.state.scheduler.stats.requests_batched == 3


def test_stop_strings_end_batched_and_single_requests_alike(server, smol):
    url, _ = server
    prompt = "The days of the week are Monday, Tuesday,"
    full = alone(smol, prompt, 24)
    stop = full[6:12]  # a stop string the greedy continuation will meet
    expected = full[: full.index(stop)]
    c = client(url)
    for temperature, extra in ((0, {}), (0, {"early_exit": {"mode": "exit", "high_conf_threshold": 1.0}})):
        response = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=temperature, stop=[stop], extra_body=extra
        )
        assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
        streamed = "".join(
            ch.choices[0].text
            for ch in c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=True, extra_body=extra
            )  # fmt: skip
            if ch.choices
        )
        assert streamed == expected


def test_a_stop_string_the_client_sees_across_a_special_token_ends_the_decode_there():
    """The client's text skips special tokens: a stop string that spans one (not EOS) ends the completion, its
    token count and the decode at the token that completes it, as vLLM stops."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(0)
    ids = torch.tensor([[5, 17, 33, 41, 9, 22, 61]])
    new = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    assert new[:4] == [90, 19, 36, 42] and 36 not in new[3:]  # greedy, on which the stop below depends
    tokenizer.add_special_tokens({"additional_special_tokens": ["w36"]})  # the text reads "w90 w19 w42 w24 ..."
    router = EarlyExitRouter.from_model(model, tokenizer, exit_layers=[1, 3], **NEVER_EXIT)
    with running_server(router, model_name="tiny") as (url, _):
        for extra in ({}, ALONE):  # batched, and on a decoder of its own
            response = client(url).completions.create(
                model="tiny", prompt=tokenizer.decode(ids[0]), max_tokens=16, temperature=0, stop=["w19 w42"],
                extra_body=extra,
            )  # fmt: skip
            assert response.choices[0].text == " w90 " and response.choices[0].finish_reason == "stop"
            assert response.usage.completion_tokens == 4  # w90 w19 w36 w42: the stop's last token ends the decode


def metaspace_tokenizer():
    """tiny_tokenizer's words under a decoder that strips a text's leading space, as Llama-2's and Mistral's do."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({"<bos>": 0, "<unk>": 1, **{f"\u2581w{i}": i for i in range(2, 96)}}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>")


def test_text_pieces_fed_token_by_token_add_up_to_the_decoded_text(smol):
    """Characters split over several byte-level tokens are held back until complete; stretches of any length add
    up to what decoding the whole completion gives."""
    tokenizer = smol.tokenizer
    text = "Größe: 東京タワー 🗼🎉 — naïve café, ünïcödé ✓ end"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode(ids[:k]) for k in range(1, len(ids)))  # a character spans tokens
    for stretch in (1, 2, 5):
        tracker, sent = TextTracker(tokenizer, ()), ""
        for k in range(0, len(ids), stretch):
            piece = tracker.add(ids[k : k + stretch])
            assert "\ufffd" not in piece
            sent += piece
        assert sent + tracker.finish() == tracker.text == text


def test_a_character_cut_off_by_max_tokens_never_reaches_the_client(smol):
    """The last tokens may hold only the first bytes of a character: that half is dropped, not sent as U+FFFD."""
    tokenizer = smol.tokenizer
    text = "東京タワー 🗼🎉"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts  # a character spans tokens
    for k in cuts:
        tracker = TextTracker(tokenizer, ())
        sent = tracker.add(ids[:k]) + tracker.finish()
        assert "\ufffd" not in sent and sent == tracker.text == tokenizer.decode(ids[:k]).rstrip("\ufffd")


def test_the_completion_text_reads_as_it_continues_the_prompt():
    """The first token's leading space survives a decoder that strips a text's leading space (the completion is
    decoded after the prompt's last tokens, as vLLM decodes), and a stop string that begins with it matches there."""
    tokenizer = metaspace_tokenizer()
    model = tiny_llama(0)
    ids = torch.tensor([[5, 17, 33, 41, 9, 22, 61]])
    new = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    prompt = tokenizer.decode(ids[0])
    whole = tokenizer.decode(ids[0].tolist() + new)
    assert whole.startswith(prompt + " ") and not tokenizer.decode(new).startswith(" ")
    router = EarlyExitRouter.from_model(model, tokenizer, exit_layers=[1, 3], **NEVER_EXIT)
    with running_server(router, model_name="tiny") as (url, _):
        c = client(url)
        for extra in ({}, ALONE):
            text = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=extra)
            assert text.choices[0].text == whole[len(prompt) :]
            streamed = c.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=extra, stream=True
            )  # fmt: skip
            assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == whole[len(prompt) :]
            first = f" w{new[0]}"
            stopped = c.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=extra, stop=[first]
            )  # fmt: skip
            assert stopped.choices[0].text == "" and stopped.usage.completion_tokens == 1


def test_api_key_is_required_when_set(smol):
    with running_server(smol, api_key="sekrit") as (url, _):
        with pytest.raises(openai.AuthenticationError):
            client(url, key="wrong").models.list()
        assert [m.id for m in client(url, key="sekrit").models.list().data] == [MODEL]


def test_stop_strings_never_reach_the_client_even_in_part(smol):
    tracker = TextTracker(smol.tokenizer, ("END",))
    sent = ""
    for piece in ["Hello", " wor", "ld E", "N", "D and more"]:
        ids = smol.tokenizer(piece, add_special_tokens=False).input_ids
        sent += tracker.add(ids)
        assert "E" not in sent[len("Hello world") :]  # a possible start of the stop string is held back
    sent += tracker.finish()
    assert sent == tracker.text == "Hello world "


def test_loadtest_checks_every_response_against_the_request_run_alone(smol):
    from early_exit_router.integrations.server.loadtest import LoadtestConfig, run_loadtest

    result = run_loadtest(smol, ["Name a colour.", "Count to three."], LoadtestConfig(2, 1, 6))
    assert result.passed, result.markdown()
    assert [a.requests for a in result.arms] == [2, 2, 2]
    assert all(a.completion_tokens > 0 and a.tokens_per_s > 0 for a in result.arms)
    assert "routing off" in result.markdown()


def test_a_request_whose_exits_stopped_says_so_in_its_block_and_in_the_metrics():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from early_exit_router.decode.stats import GenerationStats
    from early_exit_router.integrations.server.app import _routing, _StatsCollector
    from early_exit_router.integrations.server.scheduler import JobResult, SchedulerStats

    why = "no threshold held target_agreement 0.95 (disagreement 0.2-0.4 over 40 checks)"
    stopped = GenerationStats(mode="exit", new_tokens=20, exit_checked=40, exit_agreement=0.7, exits_suspended=why)
    assert _routing(JobResult("", [], "length", 3, stopped))["exits_suspended"] == why
    assert _routing(JobResult("", [], "length", 3, GenerationStats(mode="exit")))["exits_suspended"] is None
    counters = SchedulerStats()
    counters.count_finished(stopped)
    counters.count_finished(GenerationStats(mode="exit", new_tokens=5))
    registry = CollectorRegistry()
    registry.register(_StatsCollector(SimpleNamespace(stats=counters)))
    assert "eer_exits_suspended_requests_total 1.0" in generate_latest(registry).decode()
