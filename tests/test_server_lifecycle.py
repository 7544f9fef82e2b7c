"""`kiln serve`: what it serves (engine directory, cache key, config built through the cache) and how it stops
(SIGTERM drains in-flight streams, refuses new work, exits 0)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kiln.engines.cache import EngineCache
from kiln.pipeline.serve_command import serve_target
from kiln.runtime.errors import KilnError
from kiln.runtime.options import RuntimeOptions
from tests.subprocess_env import REPO, repo_env
from tests.test_server_support import tiny_engine, wait_until


def test_an_engine_directory_is_served_under_its_folder_name():
    target = serve_target(str(tiny_engine()), RuntimeOptions())
    assert target.engine_dir == tiny_engine() and target.model_name == tiny_engine().parent.name
    assert target.serve.host == "127.0.0.1" and target.serve.port == 8000 and target.serve.api_key is None


def test_a_tensorrt_llm_engine_directory_is_served_like_a_native_one(tmp_path):
    from kiln.runtime.trtllm.engine_info import TRTLLM_ENGINE_JSON

    engine = tmp_path / "llama-trt"
    engine.mkdir()
    (engine / TRTLLM_ENGINE_JSON).write_text("{}")
    target = serve_target(str(engine), RuntimeOptions())
    assert target.engine_dir == engine.resolve() and target.model_name == "llama-trt"


def test_a_directory_without_an_engine_and_an_unknown_key_are_refused(tmp_path, monkeypatch):
    with pytest.raises(KilnError, match="not an engine directory"):
        serve_target(str(tmp_path), RuntimeOptions())
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KilnError, match="there is no engine cache at"):
        serve_target("ab" * 32, RuntimeOptions())
    EngineCache.open(tmp_path / "cache")
    with pytest.raises(KilnError, match="cache key abab.*: no engine entry under"):
        serve_target("ab" * 32, RuntimeOptions())


def served_config(path: Path, serve: str) -> Path:
    """A config of the tiny test checkpoint, built natively on the CPU, with ``serve`` (its serve section)."""
    path.write_text(f"model:\n  path: {tiny_engine().parent / 'checkpoint'}\n  dtype: float32\n"
                    f"quantize:\n  format: none\nbuild:\n  backend: native\n  device: cpu\n  max_batch_size: 4\n"
                    f"  max_input_len: 32\n  max_seq_len: 64\n  max_num_tokens: 64\n  tokens_per_block: 4\n{serve}")
    return path


def test_a_config_is_built_through_the_cache_once_then_hits(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    config = served_config(tmp_path / "tiny-served.yaml", "serve:\n  port: 8123\n  max_queue: 7\n")
    first = serve_target(str(config), RuntimeOptions(), progress=False)
    second = serve_target(str(config), RuntimeOptions(), progress=False)
    assert first.engine_cache["hit"] is False and second.engine_cache["hit"] is True
    assert second.engine_dir == first.engine_dir and (second.engine_dir / "engine.json").is_file()
    assert second.model_name == "tiny-served" and second.serve.port == 8123 and second.serve.max_queue == 7
    assert second.engine_cache["hit_rate"] is not None
    key = second.engine_cache["key"]
    by_prefix = serve_target(key[:8], RuntimeOptions())  # a cached engine by its key, as `git` takes a short hash
    assert by_prefix.engine_dir == first.engine_dir and by_prefix.model_name == key[:12]
    assert serve_target(str(first.engine_dir.parent), RuntimeOptions()).engine_cache["key"] == key  # the entry
    assert by_prefix.engine_cache["remote"] is None
    monkeypatch.setenv("KILN_CACHE_REMOTE", f"file://{tmp_path / 'team'}")  # a remote named by the environment only
    assert serve_target(key, RuntimeOptions()).engine_cache["remote"] is not None  # /metrics reports it


def test_a_port_in_use_is_refused_before_a_config_is_built(tmp_path, monkeypatch):
    import socket

    from typer.testing import CliRunner

    from kiln.pipeline.cli import app as cli

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = served_config(tmp_path / "tiny-served.yaml", f"serve:\n  port: {port}\n")
        result = CliRunner().invoke(cli, ["serve", str(config)])
    assert result.exit_code != 0 and f"cannot listen on 127.0.0.1:{port}" in result.output
    assert not list((tmp_path / "cache").glob("v1/entries/*/*"))  # nothing was built


@pytest.mark.parametrize(("args", "env", "named"), [(["--api-key", " "], {}, "--api-key: the API key is blank"),
                                                    ([], {"KILN_API_KEY": " "}, "$KILN_API_KEY: the API key is blank"),
                                                    ([], {"VLLM_API_KEY": "k"},  # the config's file and line
                                                     "tiny-served.yaml:15: serve.api_key: the API key is blank"),
                                                    (["--served-model-name", ""], {}, "a model id is blank")])
def test_a_blank_api_key_or_model_name_is_refused_before_a_config_is_built(tmp_path, monkeypatch, args, env, named):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app as cli

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    serve = "serve:\n  api_key: ' '\n" if "serve.api_key" in named else ""
    config = served_config(tmp_path / "tiny-served.yaml", serve)
    result = CliRunner().invoke(cli, ["serve", str(config), "--port", "0", *args], env=env)
    assert result.exit_code == 2 and named in result.output, result.output
    assert not list((tmp_path / "cache").glob("v1/entries/*/*"))  # nothing was built


def test_the_keep_alive_timeout_comes_from_the_flag_else_vllms_variable_and_reaches_uvicorn(llm):
    from kiln.pipeline.serve_flags import KeepAliveError, keep_alive_seconds
    from kiln.runtime.server import ServerSettings, ServerThread, create_app

    assert keep_alive_seconds(None, {}) == 5.0
    assert keep_alive_seconds(90.0, {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "300"}) == 90.0  # the flag wins
    assert keep_alive_seconds(None, {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "300"}) == 300.0  # a vLLM deployment's setting
    for bad in ("soon", "0", "-5", "inf"):
        with pytest.raises(KeepAliveError, match="VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
            keep_alive_seconds(None, {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": bad})
    thread = ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny")), keep_alive_s=75.0)
    assert thread.server.config.timeout_keep_alive == 75.0


def test_an_empty_or_blank_vllm_api_key_is_no_key_as_vllm_takes_it():
    from kiln.pipeline.serve_flags import fallback_api_key, given_api_key

    for empty in ("", "  "):
        assert fallback_api_key(None, {"VLLM_API_KEY": empty}) is None
        assert given_api_key(None, {"VLLM_API_KEY": empty}) is None
    assert fallback_api_key(None, {"VLLM_API_KEY": "k"}) == ("k",)
    assert fallback_api_key("from-config", {"VLLM_API_KEY": "k"}) == ("from-config",)
    assert given_api_key(["k1", "k2"], {"KILN_API_KEY": "env"}) == ("k1", "k2")


def test_a_backend_is_checked_when_serving_an_engine_and_must_be_the_one_that_built_it():
    from kiln.pipeline.backend import UnknownBackendError
    from kiln.pipeline.targets import TargetError

    with pytest.raises(UnknownBackendError, match="--backend must be auto, native or trtllm, not 'banana'"):
        serve_target(str(tiny_engine()), RuntimeOptions(), backend="banana")
    with pytest.raises(TargetError, match="a native engine, already built, so --backend trtllm cannot apply"):
        serve_target(str(tiny_engine()), RuntimeOptions(), backend="trtllm")
    for backend in ("native", "auto"):
        assert serve_target(str(tiny_engine()), RuntimeOptions(), backend=backend).engine_dir == tiny_engine()


def test_a_tool_call_parser_is_taken_only_where_it_names_the_format_of_the_engines_template(tmp_path):
    from kiln.pipeline.serve_flags import ToolCallParserError, check_tool_call_parser

    (tmp_path / "chat_template.jinja").write_text("{% for t in tools %}{{ t }}{% endfor %} call as <tool_call>")
    check_tool_call_parser("hermes", None, tmp_path)
    check_tool_call_parser(None, None, tiny_engine())  # no flag: nothing to check
    for parser, directory, words in (("mistral", tmp_path, "teaches hermes tool calls"),
                                     ("hermes", tiny_engine(), "renders no tools"),
                                     ("pythonic", None, "not a format Kiln parses")):
        with pytest.raises(ToolCallParserError, match=words):
            check_tool_call_parser(parser, None, directory)


def test_a_corrupt_entry_in_a_read_only_cache_says_to_rebuild_it_where_the_cache_is_writable(tmp_path, monkeypatch):
    from tests.test_cache_store import as_read_only_user
    from tests.test_targets import publish

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    cache = EngineCache.open(tmp_path / "cache")
    key = publish(cache, "a")
    (cache.entries.payload_dir(key) / "engine.json").write_text("{}")  # not the bytes the manifest records
    as_read_only_user(monkeypatch)
    with pytest.raises(KilnError, match="rebuild or remove it where the cache is writable") as refused:
        serve_target(key, RuntimeOptions())
    assert "kiln cache rm" not in str(refused.value) and "--force" not in str(refused.value)


def _serve_in_subprocess(code: str) -> tuple[subprocess.Popen, queue.Queue, list[str]]:
    """``code`` (Python that serves the engine of argv[1]) in a process of its own, its stderr lines queued as they
    come, and a list for the lines read."""
    proc = subprocess.Popen([sys.executable, "-c", code, str(tiny_engine())], cwd=REPO, stderr=subprocess.PIPE,
                            text=True, env=repo_env())
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
    return proc, lines, []


def _served_url(lines: queue.Queue, logged: list[str]) -> str:
    """The URL the server announces, the lines before it read into ``logged``."""
    while not (line := lines.get(timeout=60)).startswith("serving tiny"):
        logged.append(line)
    logged.append(line)
    return re.search(r"http://127\.0\.0\.1:\d+", line).group(0)


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


def test_sigterm_finishes_the_in_flight_stream_stops_the_engine_process_and_exits_0():
    code = ("import sys; from kiln.pipeline.serve_command import serve; "
            "serve(sys.argv[1], port=0, model_names=['tiny'], shutdown_timeout=30.0, engine_process=True, "
            "access_log=True)")
    proc, lines, logged = _serve_in_subprocess(code)
    try:
        url = _served_url(lines, logged)
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=60)
        # eight samples of as many tokens as the context holds: the drain must outlast the probes below on a busy
        # machine too (one stream of 200 tokens had ended between two probes in a CI run)
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 240, "n": 8, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions",
                                                                          json=body) as response:
            events = response.iter_lines()
            next(line for line in events if line.startswith("data: "))
            engine_processes = [child for task in Path(f"/proc/{proc.pid}/task").iterdir()
                                for child in (task / "children").read_text().split()]
            proc.send_signal(signal.SIGTERM)
            # the port stays open while the stream finishes: probes see the server leave, not a refused connection
            probes = []
            wait_until(lambda: probes.append(httpx.get(f"{url}/health", timeout=5)) or probes[-1].status_code == 503,
                       timeout=10)
            assert probes[-1].json()["status"] == "draining"
            rest = [line[6:] for line in events if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["usage"]["completion_tokens"] == 8 * 240
        assert proc.wait(timeout=30) == 0
        while not lines.empty():
            logged.append(lines.get())
        stamp = r"\d{4}-\d\d-\d\d [\d:,]+ INFO"  # one format: Kiln's lines and uvicorn's, the access log's too
        assert any(line.startswith("listening on 127.0.0.1 only") and "--host 0.0.0.0" in line for line in logged)
        assert any(re.match(rf"{stamp} kiln.server \[-\]: engine loaded", line) for line in logged)
        assert any(re.match(rf"{stamp} kiln.server \[-\]: draining: 8 sequences in flight, up to 30 s", line)
                   for line in logged)
        assert any(re.match(rf'{stamp} uvicorn.access \[req_\w+\]: .*"POST /v1/completions HTTP/1.1" 200', line)
                   for line in logged)
        assert len(engine_processes) == 1
        wait_until(lambda: not Path(f"/proc/{engine_processes[0]}").exists(), timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_health_turns_503_naming_the_error_when_the_engine_thread_dies():
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.server import ServerSettings, ServerThread, create_app

    with LLM.load(tiny_engine()) as llm:

        def broken_step():
            raise RuntimeError("simulated device failure")

        with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny"))) as server:
            assert httpx.get(f"{server.url}/health").status_code == 200
            llm.engine.step = broken_step
            with pytest.raises(KilnError):
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
            response = httpx.get(f"{server.url}/health")
            assert response.status_code == 503
            assert response.json()["status"] == "error"
            assert "simulated device failure" in response.json()["message"]


def test_server_settings_take_one_string_as_one_id_and_refuse_what_would_fail_every_request():
    from kiln.runtime.server import ServerSettings

    settings = ServerSettings(model_name="m", model_aliases="gpt-4o", allowed_origins="https://a.example")
    assert settings.model_aliases == ("gpt-4o",) and settings.allowed_origins == ("https://a.example",)
    for bad, words in (({"model_name": " "}, "non-blank"), ({"max_queue": "10"}, "max_queue '10'"),
                       ({"max_body_bytes": -1}, "max_body_bytes -1"), ({"generation_config": "foo"}, "'foo'"),
                       ({"chat_template": "{% for %}"}, "not a valid Jinja template")):
        with pytest.raises(ValueError, match=re.escape(words)):
            ServerSettings(**{"model_name": "m", **bad})
    from kiln.runtime.server import create_app

    with pytest.raises(TypeError, match="settings must be a ServerSettings, got dict"):
        create_app(lambda: None, tiny_engine(), {"model_name": "m"})
    with pytest.raises(TypeError, match="llm must be an LLM or a function that loads one, got str"):
        create_app(str(tiny_engine()), tiny_engine(), settings)


def test_allowed_origins_default_to_any_and_an_empty_one_turns_cors_off(tmp_path):
    from kiln.pipeline.serve_command import ServeTarget
    from kiln.pipeline.serve_flags import cors_origins

    target = ServeTarget(engine_dir=tmp_path, model_name="tiny")
    assert target.settings().allowed_origins == ("*",)
    assert target.settings(allowed_origins=cors_origins(["https://a.example"])).allowed_origins == ("https://a.example",)
    assert target.settings(allowed_origins=cors_origins([""])).allowed_origins == ()


def test_allowed_origins_take_vllms_json_list_and_refuse_what_is_not_an_origin():
    from kiln.pipeline.serve_flags import cors_origins
    from kiln.runtime.server.cors import AllowedOriginsError

    assert cors_origins(['["https://app.example", "http://localhost:3000"]']) == ("https://app.example",
                                                                                 "http://localhost:3000")
    assert cors_origins(['["*"]']) == ("*",)
    for value in ("https://app.example/", "app.example", '["https://a.example/path"]', "[https://a.example]"):
        with pytest.raises(AllowedOriginsError, match=re.escape(value)):
            cors_origins([value])


def test_allowed_origins_are_matched_as_browsers_send_them_lowercase_without_a_default_port():
    from kiln.pipeline.serve_flags import cors_origins

    given = ["HTTPS://A.Example:443", "Http://LocalHost:80", "http://a.example:8080", "https://a.example:80", "*"]
    assert cors_origins(given) == ("https://a.example", "http://localhost", "http://a.example:8080",
                                   "https://a.example:80", "*")


def test_a_read_only_cache_whose_statistics_cannot_be_read_serves_without_the_hit_rate(tmp_path, monkeypatch, caplog):
    from tests.test_cache_store import as_read_only_user
    from tests.test_targets import publish

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_CACHE_REMOTE", f"file://{tmp_path / 'team'}")
    key = publish(EngineCache.open(tmp_path / "cache"), "a")
    (tmp_path / "cache" / "v1" / "stats.db").write_bytes(b"not a database")  # or gone: unreadable either way
    as_read_only_user(monkeypatch)
    target = serve_target(key, RuntimeOptions())
    assert target.engine_cache == {"hit": True, "hit_rate": None, "key": key, "remote": None}
    assert "stats.db: cannot be used" in caplog.text and "leaves out the engine cache's hit rate" in caplog.text


def test_the_log_level_applies_to_kilns_and_uvicorns_loggers_in_one_format(llm, tmp_path):
    import logging

    from typer.testing import CliRunner

    from kiln.pipeline.cli import app as cli
    from kiln.runtime.logs import LOG_FORMAT
    from kiln.runtime.server import ServerSettings, ServerThread, create_app

    kiln_logger = logging.getLogger("kiln")
    before = kiln_logger.level
    try:
        result = CliRunner().invoke(cli, ["serve", "/nonexistent", "--uvicorn-log-level", "WARNING"])
        assert result.exit_code == 2 and kiln_logger.level == logging.WARNING
    finally:
        kiln_logger.setLevel(before)
    result = CliRunner().invoke(cli, ["serve", "/nonexistent", "--log-level", "loud"])
    assert result.exit_code == 2 and "'debug', 'info', 'warning', 'error', 'critical'" in result.stderr
    ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny")), log_level="error")
    assert logging.getLogger("uvicorn.error").getEffectiveLevel() == logging.ERROR
    assert [handler.formatter._fmt for handler in logging.getLogger("uvicorn").handlers] == [LOG_FORMAT]
    uvicorn_logger = logging.getLogger("uvicorn")
    kept = uvicorn_logger.handlers[:]
    uvicorn_logger.handlers.clear()
    try:  # as a logging configuration file left them
        ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny")), kiln_log_format=False)
        assert uvicorn_logger.handlers == []
    finally:
        uvicorn_logger.handlers[:] = kept
    (tmp_path / "text.json").write_text("version: 1")
    (tmp_path / "v2.json").write_text('{"version": 2}')
    for config, words in (("missing.json", "cannot read the logging configuration"), ("text.json", "is not JSON"),
                          ("v2.json", '"version": 1')):
        result = CliRunner().invoke(cli, ["serve", "/nonexistent", "--log-config", str(tmp_path / config)])
        assert result.exit_code == 2 and words in result.stderr, result.stderr
    result = CliRunner().invoke(cli, ["serve", "/nonexistent"],
                                env={"VLLM_LOGGING_CONFIG_PATH": str(tmp_path / "v2.json")})
    assert result.exit_code == 2 and '"version": 1' in result.stderr  # vLLM's variable is read, never ignored


def test_the_drain_is_logged_with_what_is_in_flight_and_for_how_long(llm, caplog):
    import logging

    from kiln.runtime.server import ServerSettings, ServerThread, create_app

    server = ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny")), shutdown_timeout_s=3)
    with caplog.at_level(logging.INFO, "kiln.server"), server:
        pass
    assert "draining: 0 sequences in flight, up to 3 s to finish" in caplog.messages


def test_requests_left_when_the_shutdown_timeout_runs_out_end_with_an_error_their_clients_read():
    from kiln.runtime import LLM
    from kiln.runtime.server import ServerSettings, ServerThread, create_app

    with LLM.load(tiny_engine()) as llm:
        step = llm.engine.step
        llm.engine.step = lambda: (time.sleep(0.05), step())[1]  # 200 tokens: 10 s, far beyond the timeout
        app = create_app(llm, tiny_engine(), ServerSettings(model_name="tiny"))
        server = ServerThread(app, shutdown_timeout_s=0.5).start()
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=30) as http, ThreadPoolExecutor(1) as pool:
            plain = pool.submit(http.post, "/v1/completions", json=body)
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                events = response.iter_lines()
                next(line for line in events if line.startswith("data: "))
                wait_until(lambda: app.state.server.model.admission.outstanding == 2)
                server.stop_accepting()
                rest = [line[6:] for line in events if line.startswith("data: ")]
            assert rest[-1] == "[DONE]" and "shutdown timeout" in json.loads(rest[-2])["error"]["message"]
            assert plain.result().status_code == 503 and plain.result().headers["retry-after"] == "1"
            assert "shutdown timeout, 0.5 s, ran out" in plain.result().json()["error"]["message"]
        assert server.wait(10)


def test_a_body_that_never_ends_does_not_hold_the_server_past_its_shutdown_timeout():
    import socket

    from kiln.runtime import LLM
    from kiln.runtime.server import ServerSettings, ServerThread, create_app
    from kiln.runtime.server.serve import ABORT_FLUSH_S, CLOSE_FLUSH_S

    timeout = 4.0
    with LLM.load(tiny_engine()) as llm:
        step = llm.engine.step
        llm.engine.step = lambda: (time.sleep(0.05), step())[1]  # 240 tokens: 12 s, far beyond the timeout
        app = create_app(llm, tiny_engine(), ServerSettings(model_name="tiny"))
        server = ServerThread(app, shutdown_timeout_s=timeout).start()
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True}
        with socket.create_connection(("127.0.0.1", server.port)) as stalled, ThreadPoolExecutor(1) as pool:
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{")  # and the rest never comes
            running = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30)
            wait_until(lambda: app.state.server.model.admission.outstanding == 1)
            server.stop_accepting()
            # the drain, the abort's flush, a moment to send: not a second timeout for the stalled connection
            assert server.wait(timeout + ABORT_FLUSH_S + CLOSE_FLUSH_S)
            assert running.result().status_code == 503


def test_the_server_stops_with_an_error_when_its_engine_stops_while_serving():
    from kiln.runtime import LLM
    from kiln.runtime.server import EngineFailedError, ServerSettings, create_app, run_server

    with LLM.load(tiny_engine()) as llm:
        app = create_app(llm, tiny_engine(), ServerSettings(model_name="tiny"))
        started: queue.Queue = queue.Queue()
        outcome: queue.Queue = queue.Queue()

        def serve() -> None:
            try:
                run_server(app, "127.0.0.1", 0, on_started=started.put)
                outcome.put(None)
            except KilnError as exc:
                outcome.put(exc)

        threading.Thread(target=serve, daemon=True).start()
        url = started.get(timeout=30).url

        def broken_step():
            raise RuntimeError("simulated device failure")

        llm.engine.step = broken_step
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503 and "simulated device failure" in response.json()["error"]["message"]
        assert response.json()["error"]["type"] == "server_error"  # a stopped engine, not a server at capacity
        error = outcome.get(timeout=30)
        assert isinstance(error, EngineFailedError) and error.exit_code == 1
        assert "simulated device failure" in str(error)


def test_a_forced_exit_is_an_interruption_not_a_clean_stop():
    from kiln.runtime import LLM
    from kiln.runtime.server import ServerSettings, create_app, run_server

    def force(thread) -> None:  # what a third Ctrl-C does
        thread.server.force_exit = True
        thread.stop_accepting()

    with LLM.load(tiny_engine()) as llm, pytest.raises(KeyboardInterrupt):
        run_server(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny")), "127.0.0.1", 0,
                   on_started=force)


def test_health_is_503_once_the_embedder_closes_the_llm_it_passed_in():
    from kiln.runtime import LLM
    from kiln.runtime.server import ServerSettings, ServerThread, create_app

    llm = LLM.load(tiny_engine())
    with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny"))) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        llm.close()
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "closed" in health.json()["message"]


@pytest.fixture(autouse=True)
def openmp_policy_restored() -> Iterator[None]:
    """`kiln serve --no-engine-process` run in this process sets OMP_WAIT_POLICY: the next test gets it back."""
    before = os.environ.get("OMP_WAIT_POLICY")
    yield
    if before is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = before


@pytest.mark.parametrize("env", [{"VLLM_API_KEY": "kiln-key"}, {"KILN_API_KEY": "kiln-key", "VLLM_API_KEY": "other"}])
def test_the_api_key_comes_from_kiln_api_key_else_the_config_else_vllm_api_key(monkeypatch, env):
    from typer.testing import CliRunner

    from kiln.pipeline import cli
    from kiln.runtime import server
    from kiln.runtime.server import ServerThread

    seen = {}
    monkeypatch.setattr(server, "run_server", lambda app, *args, **kwargs: seen.update(app=app))
    result = CliRunner().invoke(cli.app, ["serve", str(tiny_engine()), "--no-engine-process"], env=env)
    assert result.exit_code == 0, result.output
    with ServerThread(seen["app"]) as running:
        wait_until(lambda: httpx.get(f"{running.url}/health", timeout=30).status_code == 200)  # the engine loads
        assert httpx.get(f"{running.url}/v1/models", timeout=30).status_code == 401
        assert httpx.get(f"{running.url}/v1/models", headers={"Authorization": "Bearer kiln-key"},
                         timeout=30).status_code == 200


def test_api_key_repeated_accepts_any_of_the_keys_as_vllms_several_keys(monkeypatch):
    from typer.testing import CliRunner

    from kiln.pipeline import cli
    from kiln.runtime import server
    from kiln.runtime.server import ServerThread

    seen = {}
    monkeypatch.setattr(server, "run_server", lambda app, *args, **kwargs: seen.update(app=app))
    args = ["serve", str(tiny_engine()), "--no-engine-process", "--api-key", "k1", "--api-key", "k2"]
    assert CliRunner().invoke(cli.app, args, env={"KILN_API_KEY": "env-key"}).exit_code == 0
    with ServerThread(seen["app"]) as running:
        wait_until(lambda: httpx.get(f"{running.url}/health", timeout=30).status_code == 200)
        for key, status in (("k1", 200), ("k2", 200), ("env-key", 401), ("k", 401)):
            headers = {"Authorization": f"Bearer {key}"}
            assert httpx.get(f"{running.url}/v1/models", headers=headers, timeout=30).status_code == status, key


@pytest.mark.parametrize(("given", "policy"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_a_server_without_an_engine_process_keeps_openmp_threads_from_spinning_unless_told(monkeypatch, given,
                                                                                            policy):
    from typer.testing import CliRunner

    from kiln.pipeline import cli
    from kiln.runtime import server

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    seen = {}
    monkeypatch.setattr(server, "run_server", lambda *args, **kwargs: seen.update(policy=os.environ["OMP_WAIT_POLICY"]))
    env = {} if given is None else {"OMP_WAIT_POLICY": given}
    result = CliRunner().invoke(cli.app, ["serve", str(tiny_engine()), "--no-engine-process"], env=env)
    assert result.exit_code == 0, result.output
    assert seen["policy"] == policy


def test_a_configs_api_key_comes_before_vllm_api_key(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from kiln.pipeline import cli
    from kiln.runtime import server
    from kiln.runtime.server import ServerThread

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    config = served_config(tmp_path / "served.yaml", "serve:\n  api_key: from-config\n")
    seen = {}
    monkeypatch.setattr(server, "run_server", lambda app, *args, **kwargs: seen.update(app=app))
    result = CliRunner().invoke(cli.app, ["serve", str(config), "--no-engine-process", "--port", "0"],
                                env={"VLLM_API_KEY": "other"})
    assert result.exit_code == 0, result.output
    with ServerThread(seen["app"]) as running:
        wait_until(lambda: httpx.get(f"{running.url}/health", timeout=30).status_code == 200)  # the engine loads
        for key, status in (("other", 401), ("from-config", 200)):
            assert httpx.get(f"{running.url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                             timeout=30).status_code == status


def test_a_server_stopped_while_its_engine_loads_stops_at_once_and_closes_what_loads_late():
    from kiln.runtime import LLM
    from kiln.runtime.server import ServerSettings, ServerThread, create_app

    release, loaded = threading.Event(), []

    def slow_load() -> LLM:  # a load that hangs (a tensor-parallel rendezvous waiting for a rank that never comes)
        release.wait(30)
        loaded.append(LLM.load(tiny_engine()))
        return loaded[0]

    server = ServerThread(create_app(slow_load, tiny_engine(), ServerSettings(model_name="tiny"))).start()
    assert httpx.get(f"{server.url}/health").json()["status"] == "loading"
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 10  # not the load's 30 s
    release.set()
    wait_until(lambda: loaded and loaded[0].closed)  # the LLM nobody will serve is closed


def test_sigterm_while_an_in_thread_load_runs_torch_exits_0():
    code = ("import sys, time, torch; from kiln.runtime import LLM; load = LLM.load.__func__\n"
            "def slow(cls, *args, **kwargs):  # a weight load or a rendezvous: inside torch when the signal comes\n"
            "    x, start = torch.randn(600, 600), time.monotonic()\n"
            "    while time.monotonic() - start < 60: x = (x @ x).tanh()\n"
            "    return load(cls, *args, **kwargs)\n"
            "LLM.load = classmethod(slow)\n"
            "from kiln.pipeline.serve_command import serve\n"
            "serve(sys.argv[1], port=0, model_names=['tiny'], engine_process=False)")
    proc, lines, logged = _serve_in_subprocess(code)
    try:
        url = _served_url(lines, logged)
        assert httpx.get(f"{url}/health").json()["status"] == "loading"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # not 134: the interpreter's teardown under the load thread aborted it
    finally:
        if proc.poll() is None:
            proc.kill()
