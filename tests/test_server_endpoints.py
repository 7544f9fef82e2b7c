"""The endpoints and flags people expect from an OpenAI-compatible server: /tokenize, /detokenize, /version, the
header naming ignored fields, vLLM's metric names, `kiln serve --chat-template` and `--served-model-name`."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from typer.testing import CliRunner

from kiln.pipeline.cli import app as cli
from kiln.runtime import KilnError, SamplingParams
from kiln.runtime.outputs import RequestMetrics, RequestOutput
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from tests.test_server_support import tiny_engine, wait_until

MODEL = "tiny"
TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>>{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %}"
            "{{ m.content }}{% endfor %}{% if add_generation_prompt %}<<A>>{% endif %}")


@pytest.fixture(scope="module")
def server(llm):
    settings = ServerSettings(model_name=MODEL, api_key="k", chat_template=TEMPLATE)
    with ServerThread(create_app(llm, tiny_engine(), settings)) as server:
        yield server


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=30) as http:
        yield http


def test_every_route_the_server_serves_is_counted_under_its_own_endpoint_label(server):
    from fastapi.routing import APIRoute

    from kiln.runtime.server.metrics import endpoint_label

    paths = {route.path_format for route in server.app.routes if isinstance(route, APIRoute)}
    assert "/tokenizer_info" in paths
    assert {path: endpoint_label(path) for path in paths if "{" not in path} == {p: p for p in paths if "{" not in p}


def test_tokenize_and_detokenize_round_trip_a_prompt_and_render_messages(http, llm):
    tokens = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()
    assert tokens["tokens"] == llm.tokenizer.encode("Once upon a time")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == llm.limits.max_request_tokens
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Once upon a time"}
    bos, eos = (llm.tokenizer.encode(text, add_special_tokens=False) for text in ("<s>", "</s>"))
    assert http.post("/detokenize", json={"tokens": [*bos, *tokens["tokens"], *eos]}).json() == {
        "prompt": "<s>Once upon a time</s>"}  # special tokens read back, as vLLM decodes them
    spelled = http.post("/tokenize", json={"prompt": "Once upon a time", "return_token_strs": True}).json()
    assert tokens["token_strs"] is None and len(spelled["token_strs"]) == tokens["count"]
    assert "".join(spelled["token_strs"]).replace("\u0120", " ").replace("\u2581", " ").endswith("Once upon a time")
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert llm.tokenizer.decode(chat["tokens"]) == "<<user>>hi<<A>>"  # the --chat-template, not the engine's own


def test_tokenize_continues_a_final_assistant_message_and_refuses_tools_the_template_does_not_render(http, llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    continued = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                             "continue_final_message": True}).json()
    assert llm.tokenizer.decode(continued["tokens"]) == "<<user>>hi<<assistant>>Once upon"
    for chat_only in ({"continue_final_message": True}, {"add_generation_prompt": False},
                      {"tools": [{"type": "function", "function": {"name": "f"}}]},
                      {"chat_template_kwargs": {"a": 1}}):
        prompt = http.post("/tokenize", json={"prompt": "hi", **chat_only})  # refused, not ignored
        assert prompt.status_code == 400 and prompt.json()["error"]["param"] == next(iter(chat_only))
    defaults = {"add_generation_prompt": True, "continue_final_message": False, "tools": [], "chat_template_kwargs": {}}
    assert http.post("/tokenize", json={"prompt": "hi", **defaults}).status_code == 200  # as vLLM clients send them
    tools = [{"type": "function", "function": {"name": "f"}}]
    for path, body in (("/tokenize", {"messages": messages[:1], "tools": tools}),
                       ("/v1/chat/completions", {"messages": messages[:1], "tools": tools, "max_tokens": 1})):
        response = http.post(path, json=body)  # the same request, the same answer
        assert response.status_code == 400 and "does not render tools" in response.json()["error"]["message"]


def test_invocations_serve_chat_and_completions_as_sagemaker_sends_them(server, http):
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.json()["object"] == "chat.completion"
    completion = http.post("/invocations", json={"prompt": "Once upon", "max_tokens": 2})
    assert completion.json()["object"] == "text_completion"
    with http.stream("POST", "/invocations", json={"prompt": "Once", "max_tokens": 2, "stream": True}) as streamed:
        assert [line for line in streamed.iter_lines() if line][-1] == "data: [DONE]"
    wrong = http.post("/invocations", json={"messages": [{"role": "robot", "content": "hi"}]}).json()["error"]
    assert wrong["param"] == "messages[0].role" and "'user'" in wrong["message"]
    neither = http.post("/invocations", json={"max_tokens": 2})
    assert neither.status_code == 400 and "'messages'" in neither.json()["error"]["message"]
    assert httpx.post(f"{server.url}/invocations", json={"prompt": "a"}).status_code == 401
    assert 'kiln_requests_total{endpoint="/invocations",status="200"} 3.0' in http.get("/metrics").text


def test_tokenizer_info_gives_what_lm_eval_harness_reads_and_its_chat_messages_are_taken(http, server):
    info = http.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"]) == ("</s>", "<s>") and info["chat_template"] == TEMPLATE
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 401  # keyed, as /tokenize is
    # lm-evaluation-harness's local-chat-completions writes "type": "text" into every message
    body = {"messages": [{"role": "user", "content": "hi", "type": "text"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_tokenize_and_detokenize_refuse_more_than_the_context_can_hold(http, llm):
    context = llm.limits.max_request_tokens
    huge = "hello " * (context * llm.tokenizer.max_token_bytes)
    response = http.post("/tokenize", json={"prompt": huge})
    assert response.status_code == 400 and "more than this model's context" in response.json()["error"]["message"]
    response = http.post("/detokenize", json={"tokens": [5] * (context + 1)})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"


def test_the_developer_role_renders_as_system(http, llm):
    chat = http.post("/tokenize", json={"messages": [{"role": "developer", "content": "Be brief."}]}).json()
    assert llm.tokenizer.decode(chat["tokens"]) == "<<system>>Be brief.<<A>>"


def test_llama31s_ipython_role_reaches_the_template_as_it_is(http, llm):
    chat = http.post("/tokenize", json={"messages": [{"role": "ipython", "content": "4 degrees"}]}).json()
    assert llm.tokenizer.decode(chat["tokens"]) == "<<ipython>>4 degrees<<A>>"


def test_an_assistant_refusal_passed_back_renders_as_what_it_said(http, llm):
    refusal = "I can't help with that."
    for message in ({"role": "assistant", "content": None, "refusal": refusal},  # an SDK message, model_dump()ed
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": refusal}]}):
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}, message]})
        assert llm.tokenizer.decode(chat.json()["tokens"]).endswith(f"<<assistant>>{refusal}<<A>>"), chat.text


def test_text_parts_join_by_newlines_and_earlier_reasoning_reaches_the_template(http, llm):
    parts = [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}]
    for key in ("reasoning_content", "reasoning"):  # DeepSeek's and vLLM's names of an assistant's reasoning
        messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "Rain.", key: "look it up"}]
        chat = http.post("/tokenize", json={"messages": messages}).json()
        assert llm.tokenizer.decode(chat["tokens"]) == "<<user>>Weather\nin Oslo?<<assistant>>(look it up)Rain.<<A>>"


def test_chat_template_kwargs_are_taken_by_tokenize_and_chat(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}}
    taken = http.post("/tokenize", json=body)  # the bundled template never reads it: named, as chat names it
    assert taken.status_code == 200 and taken.headers["kiln-ignored-fields"] == "chat_template_kwargs.enable_thinking"
    assert "kiln-ignored-fields" not in http.post("/tokenize", json={"prompt": "hi"}).headers
    refused = http.post("/tokenize", json={**body, "chat_template_kwargs": {"messages": []}})
    assert refused.status_code == 400 and "may not set messages" in refused.json()["error"]["message"]
    chat = http.post("/v1/chat/completions", json={**body, "model": MODEL, "max_tokens": 2})
    assert chat.status_code == 200, chat.text


def test_a_browser_preflight_is_answered_without_the_key_and_responses_allow_any_origin(server):
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    refused = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    exposed = refused.headers["access-control-expose-headers"].lower()  # a browser app may read them
    assert "x-request-id" in exposed and "kiln-ignored-fields" in exposed
    assert "access-control-allow-credentials" not in refused.headers


def test_allow_credentials_lets_a_browser_send_its_cookies_to_the_origin_named(llm):
    settings = ServerSettings(model_name=MODEL, allowed_origins=("https://app.example",), allow_credentials=True)
    with ServerThread(create_app(llm, tiny_engine(), settings)) as server:
        response = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example"})
    assert response.headers["access-control-allow-credentials"] == "true"
    assert response.headers["access-control-allow-origin"] == "https://app.example"


def test_an_embedders_allowed_origins_are_matched_as_browsers_send_them(llm):
    settings = ServerSettings(model_name=MODEL, allowed_origins=("HTTPS://App.Example:443", "https://bücher.example"))
    assert settings.allowed_origins == ("https://app.example", "https://xn--bcher-kva.example")
    with ServerThread(create_app(llm, tiny_engine(), settings)) as server:
        response = httpx.get(f"{server.url}/health", headers={"Origin": "https://app.example"})
    assert response.headers["access-control-allow-origin"] == "https://app.example"


@pytest.mark.parametrize(("origin", "words"), [("app.example/", "is not an origin"),
                                               ("https://*.example.com", "a '*' inside a host never matches")])
def test_an_allowed_origin_no_browser_could_send_is_refused(origin, words):
    from kiln.runtime.server.cors import AllowedOriginsError

    with pytest.raises(AllowedOriginsError, match=re.escape(words)):
        ServerSettings(model_name=MODEL, allowed_origins=(origin,))


def test_disable_fastapi_docs_serves_no_docs_nor_schema(llm):
    with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL, fastapi_docs=False))) as server:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(f"{server.url}{path}").status_code == 404, path
        assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "exactly one"),
    ("/tokenize", {}, 400, "exactly one"),
    ("/detokenize", {"tokens": [10**9]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
])
def test_bad_tokenize_requests_get_a_400(http, path, body, status, words):
    response = http.post(path, json=body)
    assert response.status_code == status and words in response.json()["error"]["message"]


def test_tokenize_needs_the_api_key_and_version_does_not(server):
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "a"}).status_code == 401
    version = httpx.get(f"{server.url}/version")
    assert version.status_code == 200 and version.json()["version"]
    health = httpx.get(f"{server.url}/health").json()
    assert httpx.get(f"{server.url}/ping").json() == httpx.post(f"{server.url}/ping").json() == health  # vLLM's
    for path in ("/health", "/ping", "/metrics"):  # a load balancer's HEAD check: the status, no body
        head = httpx.head(f"{server.url}{path}")
        assert (head.status_code, head.content) == (200, b""), path


def test_ignored_fields_are_named_in_a_header_streamed_or_not(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, store=True, user="u")
        assert raw.headers["kiln-ignored-fields"] == "store, user"
        cached = client.chat.completions.with_raw_response.create(  # fields of the current SDK's request type
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"prompt_cache_options": {"mode": "implicit"}, "moderation": None})
        assert cached.headers["kiln-ignored-fields"] == "prompt_cache_options"
        with pytest.raises(openai.BadRequestError, match="moderation"):  # asked for: no moderation runs here
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={"moderation": {"model": "omni-moderation-latest"}})
        unread = client.chat.completions.with_raw_response.create(  # the tiny model's template reads neither
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, reasoning_effort="low",
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert unread.headers["kiln-ignored-fields"] == "chat_template_kwargs.enable_thinking, reasoning_effort"
        for stream in (False, True):  # keys no header can carry are left out of it, and the request served
            odd = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=stream,
                extra_body={"chat_template_kwargs": {"日本": 1, "a\r\nX-Injected: 1": 1, "k": 1}})
            assert odd.status_code == 200 and odd.headers["kiln-ignored-fields"] == "chat_template_kwargs.k"
            odd.parse()
        with client.completions.with_streaming_response.create(model=MODEL, prompt="a", max_tokens=2, stream=True,
                                                               extra_body={"metadata": {"a": "b"}}) as stream:
            assert stream.headers["kiln-ignored-fields"] == "metadata"
        plain = client.completions.with_raw_response.create(model=MODEL, prompt="a", max_tokens=2)
        assert "kiln-ignored-fields" not in plain.headers


def test_vllm_metric_names_with_the_model_name_label(server, http, llm):
    http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 3, "ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
                 # what vLLM's own Grafana dashboard reads besides (names from before vLLM 0.11 among them)
                 "vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total",
                 "vllm:gpu_prefix_cache_hit_rate",
                 "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                 "vllm:request_max_num_generation_tokens_bucket", "vllm:request_queue_time_seconds_sum",
                 "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
                 "vllm:request_inference_time_seconds_sum"):
        assert any(line.startswith(name + "{") and f'model_name="{MODEL}"' in line for line in text.splitlines()), name
    generated = [line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 3
    three = f'vllm:request_generation_tokens_bucket{{engine="0",le="5.0",model_name="{MODEL}"}}'
    two = f'vllm:request_generation_tokens_bucket{{engine="0",le="2.0",model_name="{MODEL}"}}'
    counts = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith((three, two))}
    assert counts[three] - counts[two] >= 1  # the 3-token request, in the bucket up to 5
    prefill = [line for line in text.splitlines() if line.startswith("vllm:request_prefill_time_seconds_sum")]
    assert float(prefill[0].split()[-1]) > 0


def test_vllms_newer_metrics_split_the_waiting_requests_and_the_prompt_tokens_as_the_engine_counted_them(server, http):
    prompt = list(range(5, 45))  # 40 tokens: whole KV blocks of it are found in the prefix cache the second time
    for _ in range(2):
        http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in
              httpx.get(f"{server.url}/metrics").text.splitlines() if line.startswith("vllm:")}
    labels = f'engine="0",model_name="{MODEL}"'
    cached = values[f"vllm:prompt_tokens_cached_total{{{labels}}}"]
    prompts = values[f"vllm:prompt_tokens_total{{{labels}}}"]
    assert 0 < cached <= values[f"vllm:prefix_cache_hits_total{{{labels}}}"]
    assert values[f'vllm:prompt_tokens_by_source_total{{{labels},source="local_cache_hit"}}'] == cached
    assert values[f'vllm:prompt_tokens_by_source_total{{{labels},source="local_compute"}}'] == prompts - cached
    assert values[f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}}'] == \
        values[f"vllm:num_requests_waiting{{{labels}}}"]


def test_metrics_are_gzipped_where_the_scraper_asks_and_keep_vllms_names_when_it_asks_for_openmetrics(server, http):
    http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "ignore_eos": True})
    asked = httpx.get(f"{server.url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0",
                                                         "Accept-Encoding": "gzip"})  # as Prometheus asks
    assert asked.headers["content-encoding"] == "gzip" and asked.headers["content-type"].startswith("text/plain")
    assert "vllm:generation_tokens_total{" in asked.text  # not prometheus_client's OpenMetrics vllm_generation_...
    plain = httpx.get(f"{server.url}/metrics", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and "vllm:generation_tokens_total{" in plain.text


def http_series(server) -> dict[str, float]:
    """The server's ``http_*`` samples, by series as exposed."""
    lines = httpx.get(f"{server.url}/metrics").text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("http_")}


def test_http_series_count_requests_by_route_template_and_status_class_as_vllms_instrumentator(server, http):
    before = http_series(server)
    body = b'{"prompt": "Once", "max_tokens": 2}'
    http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert httpx.post(f"{server.url}/v1/completions", content=body).status_code == 401
    assert http.get("/v1/models/tiny").status_code == 200
    assert http.get("/scanner/probe-1").status_code == 404 and http.get("/scanner/probe-2").status_code == 404
    assert http.post("/v1/completions/", content=body).status_code == 307
    http.get("/health"), http.get("/ping"), http.get("/version")
    after = http_series(server)

    def delta(series: str) -> float:
        return after.get(series, 0.0) - before.get(series, 0.0)

    assert delta('http_requests_total{handler="/v1/completions",method="POST",status="2xx"}') == 1
    assert delta('http_requests_total{handler="/v1/completions",method="POST",status="4xx"}') == 1
    assert delta('http_requests_total{handler="/v1/models/{model_id:path}",method="GET",status="2xx"}') == 1
    assert delta('http_requests_total{handler="none",method="GET",status="4xx"}') == 2  # unknown paths share one
    assert delta('http_requests_total{handler="/v1/completions/",method="POST",status="3xx"}') == 1
    assert delta('http_request_size_bytes_sum{handler="/v1/completions"}') == 2 * len(body)
    assert delta('http_request_duration_seconds_count{handler="/v1/completions",method="POST"}') == 2
    assert delta("http_request_duration_highr_seconds_count") == 6
    assert not any(name in series for series in after for name in ("/health", "/ping", "/version", "/metrics"))
    buckets = {series: re.search(r'le="([^"]+)"', series)[1] for series in after if "_bucket" in series}
    assert {le for series, le in buckets.items() if series.startswith("http_request_duration_seconds")} == {
        "0.1", "0.5", "1.0", "+Inf"}
    assert sorted(float(le) for series, le in buckets.items() if series.startswith("http_request_duration_highr")) \
        == [0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30, 60,
            float("inf")]


def test_a_streamed_responses_http_duration_runs_until_its_last_event(server, http, llm, monkeypatch):
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (time.sleep(0.01), step())[1])  # 30 tokens: over 0.3 s
    handler = 'handler="/v1/completions",method="POST"'
    before = http_series(server)
    body = {"prompt": "Once", "max_tokens": 30, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200 and "content-length" not in response.headers
        response.read()
    wait_until(lambda: http_series(server)[f"http_request_duration_seconds_count{{{handler}}}"]
               == before.get(f"http_request_duration_seconds_count{{{handler}}}", 0) + 1)
    after = http_series(server)
    duration = after[f"http_request_duration_seconds_sum{{{handler}}}"] - before.get(
        f"http_request_duration_seconds_sum{{{handler}}}", 0)
    assert duration >= 0.3
    size = 'http_response_size_bytes_sum{handler="/v1/completions"}'
    assert after[size] == before.get(size, 0)  # a stream has no Content-Length: 0, as the instrumentator reads it


def test_vllm_request_parameters_step_tokens_and_cache_config_as_vllm_reports_them(server, http, llm):
    def scrape() -> dict[str, float]:
        lines = httpx.get(f"{server.url}/metrics").text.splitlines()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:")}

    labels = f'engine="0",model_name="{MODEL}"'
    before = scrape()
    http.post("/v1/completions", json={"prompt": ["Once", "Twice"], "n": 2, "max_tokens": 7, "ignore_eos": True})
    after = scrape()

    def delta(series: str) -> float:
        return after[series] - before.get(series, 0.0)

    assert delta(f"vllm:request_params_n_count{{{labels}}}") == 2  # two prompts, each a request of n = 2
    assert delta(f"vllm:request_params_n_sum{{{labels}}}") == 4
    assert delta(f'vllm:request_params_max_tokens_bucket{{engine="0",le="10.0",model_name="{MODEL}"}}') == 2
    assert delta(f'vllm:request_params_max_tokens_bucket{{engine="0",le="5.0",model_name="{MODEL}"}}') == 0
    steps = delta(f"vllm:iteration_tokens_total_count{{{labels}}}")
    processed = delta(f"vllm:prompt_tokens_total{{{labels}}}") + delta(f"vllm:generation_tokens_total{{{labels}}}")
    assert steps >= 7 and delta(f"vllm:iteration_tokens_total_sum{{{labels}}}") == processed  # cached prompts too
    assert delta(f'vllm:iteration_tokens_total_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}}') == steps
    assert delta(f"vllm:request_time_per_output_token_seconds_count{{{labels}}}") == 4
    info = [series for series in after if series.startswith("vllm:cache_config_info")]
    blocks = llm.stats()["kv_cache"]["num_blocks"]
    assert len(info) == 1 and f'num_gpu_blocks="{blocks}"' in info[0] and 'enable_prefix_caching="True"' in info[0]


def test_vllm_request_series_read_zero_before_the_first_request_as_vllms_do():
    from prometheus_client import CollectorRegistry, generate_latest

    from kiln.runtime.server.vllm_metrics import VllmRequestMetrics

    registry = CollectorRegistry()
    VllmRequestMetrics(MODEL, registry)
    lines = generate_latest(registry).decode().splitlines()
    for series in (f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}} 0.0',
                   f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{MODEL}"}} 0.0',
                   f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}} 0.0',
                   f'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="{MODEL}"}} 0.0',
                   f'vllm:request_params_n_count{{engine="0",model_name="{MODEL}"}} 0.0'):
        assert series in lines


def test_vllm_token_counters_read_zero_while_the_engine_loads():
    from prometheus_client import CollectorRegistry, generate_latest

    from kiln.runtime.server.vllm_metrics import VllmEngineCollector

    registry = CollectorRegistry()
    registry.register(VllmEngineCollector(MODEL, lambda: None))  # no engine stats yet
    lines = generate_latest(registry).decode().splitlines()
    for name in ("prompt_tokens", "generation_tokens"):
        assert f'vllm:{name}_total{{engine="0",model_name="{MODEL}"}} 0.0' in lines


def test_token_counters_and_vllms_earlier_prefix_cache_names_are_read_from_the_engines_stats():
    from prometheus_client import CollectorRegistry, generate_latest

    from kiln.runtime.server.vllm_metrics import VllmEngineCollector

    registry = CollectorRegistry()
    stats = {"num_prompt_tokens": 7, "num_generated_tokens": 3,
             "prefix_cache": {"queried_tokens": 8, "hit_tokens": 2, "hit_rate": 0.25}}
    registry.register(VllmEngineCollector(MODEL, lambda: stats))
    lines = set(generate_latest(registry).decode().splitlines())
    labels = f'engine="0",model_name="{MODEL}"'
    assert {f"vllm:prompt_tokens_total{{{labels}}} 7.0", f"vllm:generation_tokens_total{{{labels}}} 3.0",
            f"vllm:prefix_cache_queries_total{{{labels}}} 8.0", f"vllm:gpu_prefix_cache_queries_total{{{labels}}} 8.0",
            f"vllm:prefix_cache_hits_total{{{labels}}} 2.0", f"vllm:gpu_prefix_cache_hits_total{{{labels}}} 2.0",
            f"vllm:gpu_prefix_cache_hit_rate{{{labels}}} 0.25"} <= lines


def _finished(inter_token_latencies: list[float]) -> RequestOutput:
    """A finished request of two prompt tokens whose generated tokens came these latencies apart."""
    tokens = list(range(len(inter_token_latencies) + 1))
    metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.1, finished_time=0.1 + sum(inter_token_latencies),
                             num_prompt_tokens=2, num_cached_tokens=0, num_generated_tokens=len(tokens),
                             num_preemptions=0, inter_token_latencies=inter_token_latencies)
    return RequestOutput("r", [1, 2], "", tokens, "length", metrics)


def test_a_requests_inter_token_latencies_land_in_kilns_and_vllms_buckets_at_once():
    from kiln.runtime.server.metrics import ServerMetrics

    metrics = ServerMetrics(lambda: None, dict, lambda: None, MODEL)
    metrics.observe(_finished([0.004, 0.01, 0.3]))  # a latency on a bound counts in that bound's bucket
    metrics.observe(_finished([0.03, 3.0]))
    series = dict(line.rsplit(" ", 1) for line in metrics.exposition("")[0].decode().splitlines() if line[0] != "#")
    kiln = "kiln_inter_token_latency_seconds"
    assert [series[f'{kiln}_bucket{{le="{le}"}}'] for le in ("0.0025", "0.005", "0.01", "0.04", "0.25", "0.5",
                                                              "2.5", "+Inf")] == [
        "0.0", "1.0", "2.0", "3.0", "3.0", "4.0", "4.0", "5.0"]
    assert series[f"{kiln}_count"] == "5.0" and float(series[f"{kiln}_sum"]) == pytest.approx(3.344)
    for vllm in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        labels = f'engine="0",model_name="{MODEL}"'
        assert [series[f'{vllm}_bucket{{engine="0",le="{le}",model_name="{MODEL}"}}']
                for le in ("0.01", "0.025", "0.05", "0.2", "0.3", "2.5", "5.0", "+Inf")] == [
            "2.0", "2.0", "3.0", "3.0", "4.0", "4.0", "5.0", "5.0"]
        assert series[f"{vllm}_count{{{labels}}}"] == "5.0"
        assert float(series[f"{vllm}_sum{{{labels}}}"]) == pytest.approx(3.344)


def test_a_binned_histograms_exposition_is_prometheus_clients_histograms():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from kiln.runtime.server.binned_histogram import BinnedHistogram, Observations

    latencies = [0.015625, 0.5, 2.0**-10, 7.0]  # binary fractions: their sum is exact in any order
    buckets, labels = (0.001, 0.01, 0.5, 1.0), {"model_name": MODEL, "engine": "0"}
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("x_seconds", "Help", list(labels), buckets=buckets, registry=theirs).labels(**labels)
    for latency in latencies:
        histogram.observe(latency)
    BinnedHistogram("x_seconds", "Help", buckets, ours, labels).observe(Observations.of(latencies))

    def exposition(registry: CollectorRegistry) -> list[str]:  # the creation time told apart from its value
        return [re.sub(r"_created(\{.*\})? .*", r"_created\1", line) for line in generate_latest(registry).decode()
                .splitlines()]

    assert exposition(ours) == exposition(theirs)


def test_serve_refuses_an_unreadable_chat_template_before_building(tmp_path):
    result = CliRunner().invoke(cli, ["serve", str(tiny_engine()), "--served-model-name", "x", "--chat-template",
                                      str(tmp_path / "missing.jinja")])
    assert result.exit_code != 0 and "missing.jinja" in result.output and "cannot read" in result.output
    (tmp_path / "bad.jinja").write_text("{% for %}")
    result = CliRunner().invoke(cli, ["serve", str(tiny_engine()), "--chat-template", str(tmp_path / "bad.jinja")])
    assert result.exit_code != 0 and "not a valid Jinja template" in result.output
    assert SamplingParams  # the runtime names stay importable next to the CLI


def test_requests_take_the_sampling_defaults_of_the_models_generation_config_as_in_vllm_and_responses_echo_them(
        llm, tmp_path):
    import json
    import shutil

    engine = shutil.copytree(tiny_engine(), tmp_path / "engine")
    (engine / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 1}))
    greedy = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8))[0].text
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
    for mode, unset_is_greedy in (("auto", True), ("vllm", False)):
        settings = ServerSettings(model_name=MODEL, generation_config=mode)
        with ServerThread(create_app(llm, engine, settings)) as server, httpx.Client(base_url=server.url) as http:
            texts = {http.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(4)}
            assert (texts == {greedy}) == unset_is_greedy  # top_k 1 from the file: always the likeliest token
            overridden = {http.post("/v1/completions", json={**body, "top_k": 0, "seed": seed}).json()
                          ["choices"][0]["text"] for seed in range(4)}
            assert len(overridden) > 1  # a request's own value wins over the model's
            response = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 1}).json()
            assert (response["temperature"], response["top_p"]) == ((0.7, 1.0) if unset_is_greedy else (1.0, 1.0))
            # what it ran with, as OpenAI echoes it (before: null)


def test_a_generation_config_with_values_sampling_cannot_take_stops_the_server_naming_it(llm, tmp_path):
    import json
    import shutil

    from kiln.runtime.errors import KilnError
    from kiln.runtime.sampling_defaults import sampling_defaults

    engine = shutil.copytree(tiny_engine(), tmp_path / "engine")
    (engine / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(KilnError, match=r"generation_config.json: .*temperature"):
        sampling_defaults(engine, "auto")
    assert sampling_defaults(engine, "vllm") == {}


def test_served_model_names_after_the_first_are_aliases_requests_may_send_as_in_vllm(llm):
    from kiln.pipeline.serve_command import ServeTarget

    settings = ServeTarget(tiny_engine(), "from-config").settings(model_name="tiny", model_aliases=("gpt-4o-mini",))
    assert (settings.model_name, settings.model_aliases) == ("tiny", ("gpt-4o-mini",))
    with ServerThread(create_app(llm, tiny_engine(), settings)) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        assert [card.id for card in client.models.list()] == ["tiny", "gpt-4o-mini"]
        assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
        listed = httpx.get(f"{server.url}/v1/models/", follow_redirects=True)  # a trailing slash, as vLLM takes it
        assert [card["id"] for card in listed.json()["data"]] == ["tiny", "gpt-4o-mini"]
        out = client.completions.create(model="gpt-4o-mini", prompt="Once", max_tokens=2)
        assert out.model == "tiny"  # responses name the first, as vLLM's do
        with pytest.raises(openai.NotFoundError, match="'tiny', 'gpt-4o-mini'"):
            client.completions.create(model="other", prompt="Once", max_tokens=2)


def test_a_request_id_of_visible_ascii_is_echoed_as_vllm_does_and_one_replaced_is_logged_once(llm, caplog):
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
    with ServerThread(app) as server:
        for sent in ("abc/def==", "x" * 200, "trace:42;a=b"):
            assert httpx.get(f"{server.url}/health", headers={"X-Request-Id": sent}).headers["x-request-id"] == sent
        for refused in ("has space", "x" * 513, "has space too"):
            echoed = httpx.get(f"{server.url}/health", headers={"X-Request-Id": refused}).headers["x-request-id"]
            assert echoed.startswith("req_")
        twice = httpx.get(f"{server.url}/health", headers=[("X-Request-Id", "first"), ("X-Request-Id", "second")])
        assert twice.headers["x-request-id"] == "first"  # as Starlette reads a repeated header; before: the last
    assert [record.levelname for record in caplog.records if "X-Request-Id" in record.getMessage()] == ["WARNING"]


def test_serve_takes_an_inline_chat_template_as_vllm_does():
    from kiln.pipeline.serve_flags import read_chat_template

    assert read_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(KilnError, match="the template given inline.*not a valid Jinja template"):
        read_chat_template("{% for m in messages %}")


def test_engine_metrics_leave_out_what_the_engine_does_not_report_rather_than_fail_the_scrape():
    from kiln.runtime.server.metrics import ServerMetrics

    stats = {"load_ms": 1200.0, "num_running": 2}  # a backend that reports neither its queue nor its KV pool
    lines = ServerMetrics(lambda: stats, dict, lambda: None, MODEL).exposition("")[0].decode().splitlines()
    assert {"kiln_engine_up 1.0", "kiln_engine_load_seconds 1.2", "kiln_running_requests 2.0",
            f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 2.0'} <= set(lines)
    unreported = ("kiln_queue_depth", "kiln_kv_blocks", "kiln_prefix_cache", "kiln_preemptions", "kiln_engine_step",
                  "vllm:num_requests_waiting", "vllm:kv_cache", "vllm:gpu_cache", "vllm:num_preemptions",
                  "vllm:prefix_cache", "vllm:cache_config_info")
    assert [line for line in lines if line.startswith(unreported)] == []


def test_an_app_over_an_llm_mounted_in_the_embedders_own_app_serves_at_once(llm):
    """Starlette runs no lifespan for a mounted app: one given an LLM must not wait for one to attach it."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    mine = FastAPI()
    mine.mount("/kiln", create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL, api_key="sekret")))
    with TestClient(mine, base_url="http://testserver/kiln") as http:  # runs mine's lifespan, as uvicorn would
        assert http.get("/health").status_code == 200
        body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 2}
        for path in ("/v1/completions", "/tokenize"):  # the key guards the mounted app's routes too
            assert http.post(path, json=body).status_code == 401, path
        answer = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        metrics = http.get("/metrics").text
        assert 'kiln_requests_total{endpoint="/v1/completions",status="401"} 1.0' in metrics  # the route, not "other"


def test_a_server_thread_serves_and_drains_an_app_that_mounts_kiln(llm):
    from fastapi import FastAPI

    mine, kiln = FastAPI(), create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
    mine.mount("/kiln", kiln)
    with ServerThread(mine) as server:  # before: AttributeError, the outer app holds no Kiln state
        assert httpx.get(f"{server.url}/kiln/health").status_code == 200
        server.stop_accepting()
        assert server.wait(10) and kiln.state.server.draining  # the mounted app drained, and the server stopped
    with pytest.raises(TypeError, match="no app create_app made is served or mounted"):
        ServerThread(FastAPI())


def test_while_draining_every_response_closes_its_connection(llm):
    from fastapi.testclient import TestClient

    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
    with TestClient(app) as http:
        assert "close" not in http.get("/health").headers.get("connection", "")
        app.state.server.draining = True  # as stop_accepting sets it
        for answer in (http.get("/health"), http.post("/v1/completions", json={"model": MODEL, "prompt": "a"})):
            # a pooled client's next request opens a connection afresh, which can reach another replica
            assert answer.status_code == 503 and answer.headers["connection"] == "close"
