"""The public API: one background engine thread serving any number of threads and asyncio tasks."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import numbers
import os
import queue
import threading
import time
import uuid
import weakref
from collections import abc
from collections.abc import AsyncGenerator, Callable, Mapping
from concurrent.futures import Future, wait
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.runtime.attribute_hints import hinted_attribute
from kiln.runtime.cache_hold import EntryHold, hold_if_cached
from kiln.runtime.chat_template_files import ChatTemplateFiles
from kiln.runtime.closed_engine import ClosedEngine
from kiln.runtime.conversations import as_conversations, load_template, render_prompts
from kiln.runtime.delivery import ABORTING, Outbox, Sink, settle
from kiln.runtime.engine import Engine, engine_loader
from kiln.runtime.errors import EngineClosedError, EngineFormatError, InvalidRequestError, KilnError
from kiln.runtime.limits import EngineLimits
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.outputs import RequestFailure, RequestOutput, StreamDelta
from kiln.runtime.progress import wait_showing_progress
from kiln.runtime.sampling_defaults import described, sampling_defaults
from kiln.runtime.sampling_params import SamplingParams, sample_seed
from kiln.runtime.sequence import Sequence
from kiln.runtime.tokenizer import Tokenizer
from kiln.runtime.tokenizer_files import TOKENIZER_JSON, partial_tokenizer_files
from kiln.runtime.vllm_call_options import (
    CHAT_OPTIONS,
    GENERATE_OPTIONS,
    check_engine_arguments,
    check_vllm_call_options,
)

if TYPE_CHECKING:  # jinja2 is imported only when a chat is rendered
    from kiln.runtime.chat_template import ChatTemplate

logger = logging.getLogger("kiln.runtime")

# text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}
Prompt = str | list[int] | tuple[int, ...] | dict[str, Any]
# vLLM's LLM attributes that Kiln's has under another name, or not at all, and what to use
VLLM_ATTRIBUTES = {
    "get_tokenizer": "use llm.tokenizer (encode / decode; for a chat template, llm.chat renders it)",
    "get_default_sampling_params": "use llm.default_params",
    "llm_engine": "llm.engine is the engine; llm.stats() and llm.limits describe it",
    "reset_prefix_cache": "Kiln frees cached blocks as the pool needs them; LLM.load a fresh engine to start empty",
    "beam_search": "Kiln samples or decodes greedily, without beams",
    "encode": "Kiln's engines generate text; they make no embeddings",
    "embed": "Kiln's engines generate text; they make no embeddings",
    "start_profile": "profile with torch.profiler around generate, or tools/bench_step.py --profile",
    "get_metrics": "use llm.stats() (counters, latency summaries, the KV pool)",
    "set_tokenizer": "an engine holds the tokenizer it was built with: kiln build with another",
    "sleep": "llm.close() frees the GPU; LLM.load the engine again to wake it",
    "wake_up": "llm.close() frees the GPU; LLM.load the engine again to wake it",
    "preprocess_chat": "llm.chat renders messages through the chat template; llm.tokenizer encodes text",
    "score": "Kiln's engines generate text; they score and classify nothing",
    "classify": "Kiln's engines generate text; they score and classify nothing",
}


class LLM:
    """Load an engine and serve it: `generate`, `chat`, `generate_async`, `stream`, `submit`/`result`, `abort`, `stats`;
    `tokenizer`, `limits` and `check` describe what it accepts.

    All callers share one engine thread, so requests from many threads and event loops are batched together.
    """

    def __init__(self, engine: Engine | str | os.PathLike | None = None, options: RuntimeOptions | None = None, *,
                 model: str | os.PathLike | None = None, **vllm_engine_arguments: object) -> None:
        """Load the engine `kiln build` made in the directory ``engine`` (or ``model``, vLLM's name) with
        ``options``, as ``LLM.load`` does; or serve an ``Engine`` object already loaded. vLLM's engine arguments
        are taken at values that change nothing (``dtype="auto"``, ``tensor_parallel_size`` equal to the engine's,
        ...); others (``gpu_memory_utilization=``, ...) are refused, all at once, saying where Kiln takes each."""
        if model is not None:
            if engine is not None:
                raise TypeError("name the engine directory once: LLM(engine_dir) or LLM(model=engine_dir)")
            engine = model
        if vllm_engine_arguments:
            check_engine_arguments(vllm_engine_arguments,
                                   Path(engine).expanduser() if isinstance(engine, str | os.PathLike) else None,
                                   options)
        load_ms, hold, default_params, engine_dir, chat_template_files = 0.0, None, SamplingParams(), None, None
        if isinstance(engine, str | os.PathLike):
            if not os.fspath(engine).strip():  # Path("") is the current folder
                raise EngineFormatError("the engine directory is an empty path: pass the directory `kiln build` "
                                        "printed")
            engine, load_ms, hold, default_params, engine_dir, chat_template_files = _load(Path(engine).expanduser(),
                                                                                          options)
        elif engine is None:
            raise TypeError("LLM() needs an engine: LLM(model=engine_dir) or LLM.load(engine_dir, RuntimeOptions(...))")
        elif not callable(getattr(engine, "has_unfinished", None)):  # an Engine is a Protocol, not a class
            raise TypeError(f"LLM takes an engine directory (a str or a Path) or a loaded Engine, got "
                            f"{type(engine).__name__}")
        elif options is not None:
            raise TypeError("options are for loading an engine: LLM(engine_dir, RuntimeOptions(...))")
        self.engine: Engine | ClosedEngine = engine  # a ClosedEngine once closed
        self.load_ms = load_ms
        self.default_params = default_params  # what a request given no SamplingParams takes
        self.engine_dir = engine_dir  # where the engine was loaded from, if it was
        self._chat_template_files = chat_template_files  # read at the load: chat() needs the directory no more
        self._chat_template: ChatTemplate | None = None  # that template, compiled at the first chat()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        # ids freed by a caller that went away, before the engine's final delta for them (``_abandon``): how many such
        # final deltas are still to come, each dropped
        self._freed_ids: dict[str, int] = {}
        self._results: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self._released = threading.Event()  # close() has freed the engine
        self._closing = threading.Lock()  # held by the one close() at work; the next takes over if it is interrupted
        self._outbox = Outbox()  # touched by the engine thread only
        self._warm = threading.Event()  # the engine's deferred warm-up is done (or the engine thread has stopped)
        self._pid = os.getpid()  # it serves the process that loaded it, never a fork of it
        # the thread holds the LLM only while it works, so an LLM dropped without close() is collected, and its
        # finalizer frees the engine (weights, KV pool, an engine process) and the cache hold
        self._thread = threading.Thread(target=_engine_thread, args=(weakref.ref(self),), name="kiln-engine",
                                        daemon=True)
        self._release = weakref.finalize(self, _release_engine, engine, hold)
        self._release.atexit = False  # at exit, _close_open_llms stops the thread first
        self._thread.start()
        _open.add(self)

    @classmethod
    def load(cls, engine_dir: str | Path, options: RuntimeOptions | None = None) -> LLM:
        """Load the engine in ``engine_dir`` (the directory `kiln build` printed) with ``options`` (device, kernels,
        CUDA graphs, KV pool size...; default ``RuntimeOptions()``: the engine's own device, everything on).
        `load_ms` records how long it took, leaving out the first import of the backend's modules (torch) in the
        process. A cached engine stays in the cache while it is loaded."""
        return cls(engine_dir, options)

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (None when the engine has no tokenizer.json and takes token ids only)."""
        return self.engine.tokenizer

    @property
    def engine_pid(self) -> int | None:
        """The id of the engine's own process when it runs in one (``RuntimeOptions.engine_process``), else None."""
        return getattr(self.engine, "pid", None)

    @property
    def worker_pids(self) -> dict[int, int]:
        """The process ids, by rank, of the tensor-parallel workers (ranks 1 and up) that run on this host, started by
        the engine; empty for one device, ranks that torchrun started, and a closed engine."""
        return getattr(self.engine, "worker_pids", {})

    @property
    def limits(self) -> EngineLimits:
        """What one request may ask: max_input_len, max_seq_len, max_batch_size, max_num_tokens, kv_pool_tokens."""
        return self.engine.limits

    def check(self, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Raise what `generate` would raise for this prompt (RequestTooLongError, InvalidRequestError,
        EngineClosedError, ...), without running it: with ``n`` > 1, what each sample's request would (``submit``
        and the streams take n = 1 only)."""
        self._check_open()
        self.engine.make_request(uuid.uuid4().hex, prompt, _sample(_taken(params, self.default_params), 0))

    def __enter__(self) -> LLM:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | abc.Sequence[Prompt] | None = None,
                 params: SamplingParams | abc.Sequence[SamplingParams] | None = None, *,
                 sampling_params: SamplingParams | abc.Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = False, **vllm_options: object) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); blocks until all are done. Outputs follow the prompts' order.
        ``sampling_params`` is vLLM's name for ``params``; ``use_tqdm`` draws a progress bar on stderr (True: tqdm's;
        a tqdm-like class, as vLLM takes, draws its own). vLLM's ``lora_request``, ``priority`` and
        ``tokenization_kwargs`` are taken at their defaults (None, 0); its former ``prompt_token_ids`` is refused
        saying how to pass them."""
        if vllm_options.pop("prompt_token_ids", None) is not None:
            raise TypeError("LLM.generate() takes token ids as its prompts, not as vLLM's former prompt_token_ids=: "
                            "llm.generate([{'prompt_token_ids': ids}, ...], sampling_params), or the lists of ids "
                            "themselves")
        check_vllm_call_options("generate", vllm_options, GENERATE_OPTIONS)
        if not isinstance(prompts, str | list | tuple | dict):
            raise InvalidRequestError(f"prompts must be text, token ids, or a list of those; got "
                                      f"{type(prompts).__name__}")
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        return self._generate(prompts, _one_of(params, sampling_params), use_tqdm, list(map(_prompt_text, prompts)))

    def _generate(self, prompts: abc.Sequence[Prompt], params: SamplingParams | abc.Sequence[SamplingParams] | None,
                  use_tqdm: bool | Callable[..., Any], texts: list[str | None],
                  what: str = "prompts") -> list[RequestOutput]:
        """``generate`` of a list of prompts (``what`` they are, for an error) whose outputs carry ``texts`` as their
        ``prompt``: ``n`` requests of a prompt whose SamplingParams ask ``n`` samples, one output holding them all."""
        per_prompt = _per_prompt(params, len(prompts), self.default_params, what)
        samples = [sp.n for sp in per_prompt]
        requests = [(index, number) for index, count in enumerate(samples) for number in range(count)]
        which = [index for index, _ in requests]  # each request's prompt
        seqs = self._make_requests([prompts[i] for i in which],
                                   [_sample(per_prompt[i], number) for i, number in requests], prompt_index=which)
        try:
            futures = self._enqueue(seqs, [Sink(prompt=texts[i]) for i in which])
            if use_tqdm:
                wait_showing_progress(futures, use_tqdm if callable(use_tqdm) else None)  # a class, as vLLM's
            return _grouped([f.result() for f in futures], samples)
        except BaseException:
            for seq in seqs:
                self.abort(seq.request_id)
            raise

    def chat(self, messages: abc.Sequence[Mapping[str, Any]] | abc.Sequence[abc.Sequence[Mapping[str, Any]]],
             params: SamplingParams | abc.Sequence[SamplingParams] | None = None, *,
             sampling_params: SamplingParams | abc.Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = False,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: abc.Sequence[Mapping[str, Any]] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None, **vllm_options: object) -> list[RequestOutput]:
        """Complete one conversation (a list of ``{"role", "content"}`` messages, OpenAI's and vLLM's shape) or a
        list of them, each rendered through the engine's chat template (its ``tool_use`` one with ``tools``, where
        it has one; ``chat_template``: another template's source in its place, or the name of one of the engine's
        named templates) with ``tools`` and the template's further variables ``chat_template_kwargs``, as vLLM's
        ``LLM.chat``; one output per conversation. With ``continue_final_message`` (and
        ``add_generation_prompt=False``) the completion continues the final message. vLLM's ``lora_request``,
        ``chat_template_content_format``, ``mm_processor_kwargs`` and ``tokenization_kwargs`` are taken at their
        defaults (None, "auto")."""
        check_vllm_call_options("chat", vllm_options, CHAT_OPTIONS)
        self._check_open()
        template = self._chat_template if chat_template is None else None
        if template is None:
            template = load_template(self._chat_template_files, chat_template)
            if chat_template is None:
                self._chat_template = template
        rendered = render_prompts(as_conversations(messages), template, self.tokenizer,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, tools=tools,
                                  chat_template_kwargs=chat_template_kwargs)
        return self._generate([ids for _, ids in rendered], _one_of(params, sampling_params), use_tqdm,
                              [text for text, _ in rendered], "conversations")

    async def generate_async(self, prompt: Prompt, params: SamplingParams | None = None, *,
                             request_id: str | None = None) -> RequestOutput:
        """Complete one prompt without blocking the event loop; cancelling the task aborts the request, and
        ``abort(request_id)`` ends it with what it generated so far (finish_reason "abort")."""
        loop = asyncio.get_running_loop()
        seq = self.engine.make_request(request_id or uuid.uuid4().hex, prompt, _taken(params, self.default_params))
        result = loop.create_future()
        sink = Sink(loop=loop, push=functools.partial(settle, result), every_delta=False, prompt=_prompt_text(prompt))
        self._enqueue([seq], [sink])
        try:
            return await result
        except asyncio.CancelledError:
            self._abandon(seq.request_id, sink)
            raise

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncGenerator[StreamDelta, None]:
        """Yield what each step adds (text and token ids) until the request finishes; closing the generator
        early aborts the request."""
        async with contextlib.aclosing(self.stream_many([prompt], params)) as batches:
            async for batch in batches:
                for _, delta in batch:
                    yield delta

    async def stream_many(self, prompts: abc.Sequence[Prompt],
                          params: SamplingParams | abc.Sequence[SamplingParams] | None = None, *,
                          on_finished: Callable[[], None] | None = None, request_ids: abc.Sequence[str] | None = None,
                          final_only: bool = False) -> AsyncGenerator[list[tuple[int, StreamDelta]], None]:
        """Stream several prompts at once: each item is every ``(prompt index, delta)`` that arrived since the last
        one (at least one), so a consumer that falls behind catches up in one go. Ends when all have finished;
        closing the generator early (``aclose()``; a ``break`` leaves that to Python, a loop turn or two later) aborts
        the requests still running and frees their ids at once. The engine takes
        the requests together, in one step (identical calls on an idle engine batch identically). ``on_finished`` is
        called (on this loop) once the engine is done with every request, before the consumer has read their last
        deltas (not once the generator was closed early);
        ``request_ids`` (default: fresh ones) are what ``abort`` takes; ``final_only``: each request's last delta
        only (its ``output``), none of the steps before."""
        if isinstance(prompts, str) or (isinstance(prompts, abc.Sequence) and prompts
                                        and isinstance(prompts[0], numbers.Integral)):
            raise InvalidRequestError("stream_many takes a list of prompts (texts or token-id lists), and this is one "
                                      "prompt: pass [prompt], or call stream()")
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue[tuple[int, StreamDelta | BaseException]] = asyncio.Queue()
        seqs = self._make_requests(prompts, _per_prompt(params, len(prompts), self.default_params), request_ids)
        remaining, running = set(), set(range(len(seqs)))

        def push(index: int, item: StreamDelta | BaseException) -> None:
            arrived.put_nowait((index, item))
            if index in running and (isinstance(item, BaseException) or item.finished):
                running.discard(index)
                if not running and on_finished is not None:
                    on_finished()

        sinks = [Sink(loop=loop, push=functools.partial(push, index), every_delta=not final_only,
                      prompt=_prompt_text(prompt)) for index, prompt in enumerate(prompts)]
        try:
            self._enqueue(seqs, sinks)
            remaining.update(range(len(seqs)))
            while remaining:
                batch = [await arrived.get()]
                while not arrived.empty():
                    batch.append(arrived.get_nowait())
                for index, item in batch:
                    if isinstance(item, BaseException):
                        raise item
                    if item.finished:
                        remaining.discard(index)
                yield batch
        finally:
            for index in remaining:
                self._abandon(seqs[index].request_id, sinks[index])

    def _make_requests(self, prompts: abc.Sequence[Prompt], params: list[SamplingParams],
                       request_ids: abc.Sequence[str] | None = None,
                       prompt_index: abc.Sequence[int] | None = None) -> list[Sequence]:
        """One validated request per prompt, with its params (``_per_prompt``'s checked copies), under
        ``request_ids`` (one per prompt; default fresh ones); an error names the prompt by its ``prompt_index``
        (default its position)."""
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(request_ids)} request ids: pass one per prompt")
        ids = request_ids if request_ids is not None else [uuid.uuid4().hex for _ in prompts]
        seqs = []
        for index, (request_id, prompt, sp) in enumerate(zip(ids, prompts, params, strict=True)):
            try:
                seqs.append(self.engine.make_request(request_id, prompt, sp))
            except InvalidRequestError as e:  # RequestTooLongError included
                if len(set(prompt_index or range(len(prompts)))) == 1:
                    raise
                raise type(e)(f"prompts[{prompt_index[index] if prompt_index else index}]: {e}") from e
        return seqs

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None) -> str:
        """Queue a request and return its id at once; collect it with `result(request_id)`."""
        seq = self.engine.make_request(request_id or uuid.uuid4().hex, prompt, _taken(params, self.default_params))
        (future,) = self._enqueue([seq], [Sink(prompt=_prompt_text(prompt))])
        with self._lock:
            self._results[seq.request_id] = future
        return seq.request_id

    def result(self, request_id: str, timeout: float | None = None) -> RequestOutput:
        """Wait for a submitted request (finish_reason "abort" if it was aborted); each id can be collected once.
        After a ``TimeoutError`` the request runs on and can be waited for again, or aborted and then collected: a
        submitted request's output is kept until ``result`` takes it, aborted or not."""
        self._check_not_forked()  # a fork has no engine thread to finish it
        with self._lock:
            future = self._results.get(request_id)
        if future is None:
            raise KeyError(f"no submitted request {request_id!r} awaits collection")
        if not wait([future], timeout).done:
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout} s; it runs on")
        with self._lock:
            self._results.pop(request_id, None)
        return future.result()

    def wait_until_warm(self, timeout: float | None = None) -> bool:
        """Wait until the engine has done the warm-up its load deferred (the native engine captures its CUDA graphs
        while idle, or on the first step that needs each: ``RuntimeOptions.cuda_graph_capture``); requests are served
        meanwhile. True once it is warm, False if ``timeout`` seconds passed first."""
        self._check_not_forked()  # a fork has no engine thread to warm it
        warm = self._warm.wait(timeout)
        self._check_open()
        return warm

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its waiter gets what was generated, with finish_reason "abort"."""
        self._commands.put(("abort", request_id))

    def abort_all(self, error: BaseException) -> int:
        """Fail every request in flight with ``error`` (their callers get it at once) and abort them in the engine,
        freeing their KV blocks; returns how many there were. The LLM stays open for new requests."""
        request_ids = self._fail_all(error, reserve=True)  # exactly those it failed, one added meanwhile included
        for request_id in request_ids:
            self._commands.put(("abort", request_id))
        return len(request_ids)

    def stats(self) -> dict:
        """Step, KV-pool, prefix-cache, preemption and request-latency statistics, plus `load_ms`."""
        return {"load_ms": self.load_ms, **self.engine.stats_snapshot()}

    def close(self) -> None:
        """Stop the engine thread and free the engine, even while the caller still holds this LLM (which keeps its
        tokenizer, limits and last stats); requests still in flight fail with EngineClosedError. A step that has not
        returned within ``STEP_GRACE_S`` (a hung GPU) is interrupted where the engine can be (an engine process is
        killed). A second close, from any thread, returns once the first has freed the engine. A close interrupted
        while it waits for the step (Ctrl-C) fails the requests in flight at once, and the next close (or the one at
        exit) frees the engine."""
        if self._pid != os.getpid():  # a fork's copy (its lock may be held): the engine is the parent's to free
            self._closed = True
            return
        with self._lock:
            self._closed = True
        with self._closing:  # another caller closing it: once that has freed the engine, or taking over from it
            if self._released.is_set():
                return
            closed = EngineClosedError("the LLM was closed before this request finished")
            try:
                self._commands.put(("close", None))
                self._thread.join(STEP_GRACE_S)
                if self._thread.is_alive() and self.engine.interrupt():
                    logger.warning("the engine did not stop within %s s of close: its process was killed",
                                   STEP_GRACE_S)
                self._thread.join()
            finally:
                self._fail_all(closed)  # none waits on an interrupted close
            self.engine = ClosedEngine(self.engine)  # first: no other thread reaches the engine once it is freed
            try:
                if (finalizer := self._release.detach()) is not None:  # a call would do nothing once atexit has run
                    _release_engine(*finalizer[2])  # the engine itself (weights, KV pool) goes, even while the
                    # caller holds this LLM
            finally:
                self._released.set()

    def _stop_reason(self) -> BaseException | None:
        """Why the engine stopped: the engine thread's error, else what the engine noticed while idle
        (``Engine.failure``: a worker or engine process that exited); None while it serves, or once closed."""
        if self._error is not None or self._closed:
            return self._error
        return self.engine.failure()

    def _check_open(self) -> None:
        self._check_not_forked()
        error = self._stop_reason()
        if error is not None:
            raise EngineClosedError(f"the engine stopped ({error}): close this LLM and load the engine again")
        if self._closed:
            raise EngineClosedError("the LLM is closed: load it again")

    def _enqueue(self, seqs: list[Sequence], sinks: list[Sink]) -> list[Future]:
        """Queue requests as one command: the engine takes them all before its next step (a request's choices, or
        a batch of prompts, then always start together); none is queued when one's id is taken."""
        self._check_not_forked()  # before the lock, which the parent's engine thread may have held at the fork
        with self._lock:
            self._check_open()
            ids: dict[str, Sink] = {}
            for seq, sink in zip(seqs, sinks, strict=True):
                if seq.request_id in ids or seq.request_id in self._sinks or seq.request_id in self._results:
                    raise InvalidRequestError(f"request id {seq.request_id!r} is already in use: pick a unique id")
                ids[seq.request_id] = sink
            self._sinks.update(ids)
        self._commands.put(("add", seqs))
        return [sink.future for sink in sinks]

    def _abandon(self, request_id: str, sink: Sink) -> None:
        """Abort a request whose caller has gone (a cancelled task, a closed stream) and free its id at once, as
        vLLM's AsyncLLM does: the engine's results for it until its final delta are dropped, so a request that reuses
        the id gets none of them."""
        with self._lock:
            if self._sinks.get(request_id) is not sink:  # it finished or failed already (or abort_all reserved it)
                return
            del self._sinks[request_id]
            self._freed_ids[request_id] = self._freed_ids.get(request_id, 0) + 1
            # under the lock: the engine takes this abort before the add of any request that reuses the id
            self._commands.put(("abort", request_id))

    def _dropped(self, request_id: str, final: bool) -> bool:
        """Whether a result for ``request_id`` is an abandoned request's (``_abandon``), which nobody reads; its
        ``final`` one ends it. Called under the lock."""
        if (count := self._freed_ids.get(request_id, 0)) and final:
            if count == 1:
                del self._freed_ids[request_id]
            else:
                self._freed_ids[request_id] = count - 1
        return count > 0

    def _forked(self) -> EngineClosedError | None:
        """The refusal of a fork of the process that loaded this LLM (the fork has no engine thread, and the engine,
        an engine process or a device, is the parent's); None in that process."""
        if self._pid == os.getpid():
            return None
        return EngineClosedError(
            f"this LLM was loaded in process {self._pid}, and process {os.getpid()} is a fork of it: an engine does "
            f"not survive fork(). Load it in each worker after the fork (gunicorn: without --preload, or in "
            f"post_fork; multiprocessing: the 'spawn' or 'forkserver' start method)")

    def _check_not_forked(self) -> None:
        if (forked := self._forked()) is not None:
            raise forked

    def __reduce__(self) -> None:
        raise TypeError("an LLM cannot be sent to another process: LLM.load the engine there")

    if not TYPE_CHECKING:  # type checkers keep catching a misspelt attribute

        def __getattr__(self, name: str) -> Any:
            """Only for a name the LLM lacks (or a property that raised AttributeError): vLLM's name of something
            Kiln has under another says so in the error."""
            return hinted_attribute(self, name, VLLM_ATTRIBUTES)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called: every request is then refused."""
        return self._closed

    @property
    def engine_error(self) -> str | None:
        """Why the engine stopped, or None while it serves (a health check reads this): the engine thread's error, or
        what the engine noticed while idle (``Engine.failure``: a worker or engine process that exited)."""
        if (forked := self._forked()) is not None:  # before the lock, which the parent's thread may have held
            return f"{type(forked).__name__}: {forked}"
        with self._lock:
            error = self._stop_reason()
        return None if error is None else f"{type(error).__name__}: {error}"

    def _turn(self) -> bool:
        """One turn of the engine thread: the queued commands (waiting up to IDLE_WAKE_S for one when there is
        nothing to run), then a step or a warm-up step; False once closed, or once the engine failed."""
        try:
            if not self._handle_commands(block=not self.engine.has_unfinished() and self._warm.is_set()):
                self._outbox.flush()
                self._warm.set()
                return False
            if self.engine.has_unfinished():
                for result in self.engine.step():
                    if isinstance(result, RequestFailure):
                        self._fail(result.request_id, result.error)
                    else:
                        self._deliver(result)
            elif not self._warm.is_set() and not self.engine.warm_up_step():
                self._warm.set()
            for request_id in self._outbox.flush():
                self._commands.put(("abort", request_id))
            return True
        except BaseException as e:  # a bug in the engine: fail every waiter rather than hang it
            if self._closed:  # close interrupted a step that did not return (its warning said so): no bug of ours
                logger.info("the engine thread stopped as it was closed: %s: %s", type(e).__name__, e)
            else:
                logger.error("the engine thread stopped", exc_info=e)
            self._outbox.flush()
            with self._lock:
                self._error = e
            stopped = EngineClosedError(f"engine thread stopped: {type(e).__name__}: {e}")
            stopped.__cause__ = e  # where in the engine it failed
            self._fail_all(stopped)
            self._warm.set()  # a waiter learns from _check_open that the engine stopped
            return False

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once asked to close."""
        while True:
            try:
                kind, arg = self._commands.get(timeout=IDLE_WAKE_S) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "close":
                return False
            if kind == "add":
                for seq in arg:
                    try:
                        self.engine.add_request(seq)
                    except InvalidRequestError as e:  # this request's fault; anything else stops the engine
                        self._fail(seq.request_id, e)
            elif (delta := self.engine.abort_request(arg)) is not None:
                self._deliver(delta)

    def _deliver(self, delta: StreamDelta) -> None:
        with self._lock:
            if self._dropped(delta.request_id, delta.finished):
                return
            sink = self._sinks.pop(delta.request_id, None) if delta.finished else self._sinks.get(delta.request_id)
        if sink is None or sink is ABORTING:
            return
        if delta.output is not None:
            delta.output.prompt = sink.prompt
        if sink.loop is not None:
            if sink.loop.is_closed() and not delta.finished:  # nobody can read it any more: free its blocks now
                self._commands.put(("abort", delta.request_id))
            elif delta.finished or sink.every_delta:
                self._outbox.add(delta.request_id, sink, delta)
        elif delta.finished:
            sink.future.set_result(delta.output)

    def _fail(self, request_id: str, error: BaseException) -> None:
        """Fail one request (delivered with the engine iteration's other results)."""
        with self._lock:
            if self._dropped(request_id, final=True):
                return
            sink = self._sinks.pop(request_id, None)
        if sink is ABORTING:
            return
        if sink is not None and sink.loop is not None:
            self._outbox.add(request_id, sink, error)
        elif sink is not None:
            sink.future.set_exception(error)

    def _fail_all(self, error: BaseException, reserve: bool = False) -> list[str]:
        """Fail every request still in flight, at once; their ids. With ``reserve`` (their aborts follow) each id
        stays taken until the engine's final delta for it, so that a request reusing it never gets that delta."""
        with self._lock:
            sinks = {request_id: sink for request_id, sink in self._sinks.items() if sink is not ABORTING}
            self._sinks = dict.fromkeys(self._sinks, ABORTING) if reserve else {}
        outbox = Outbox()
        for request_id, sink in sinks.items():
            if sink.loop is not None:
                outbox.add(request_id, sink, error)
            else:
                sink.future.set_exception(error)
        outbox.flush()
        return list(sinks)


STEP_GRACE_S = 10.0  # how long close waits for the engine's step before it interrupts it
IDLE_WAKE_S = 1.0  # how often an idle engine thread lets go of its LLM, so that a dropped one can be collected


def _load(engine_dir: Path, options: RuntimeOptions | None
          ) -> tuple[Engine, float, EntryHold | None, SamplingParams, Path, ChatTemplateFiles]:
    """``LLM.load``'s work: the engine in ``engine_dir``, the milliseconds its load took, its cache hold, the
    model's default SamplingParams, the directory, and its chat template's files (read before the engine is
    loaded and held, so that nothing fails after)."""
    if options is not None and not isinstance(options, RuntimeOptions):
        raise TypeError(f"options must be a RuntimeOptions, got {type(options).__name__}: "
                        "LLM.load(path, RuntimeOptions(...))")
    if not engine_dir.is_dir():
        raise EngineFormatError(f"{engine_dir}: not an engine directory; pass the directory `kiln build` printed "
                                f"(`kiln cache show KEY` shows a cached engine's)")
    if partial := partial_tokenizer_files(engine_dir):
        raise EngineFormatError(f"{engine_dir / TOKENIZER_JSON}: missing, though the engine has the rest of its "
                                f"tokenizer ({', '.join(partial)}): an incomplete copy (copy the engine again from "
                                f"where it was built), or an engine built from a checkpoint without a tokenizer.json "
                                f"(rebuild it from one that has it; only token-id prompts could reach it)")
    options = options or RuntimeOptions()
    default_params = _model_default_params(engine_dir)  # a bad generation_config.json: warned of before the load
    chat_template_files = ChatTemplateFiles.read(engine_dir)
    load = engine_loader(engine_dir, options)
    start = time.perf_counter()
    hold = hold_if_cached(engine_dir)  # a cached engine is not evicted while this LLM has it loaded
    try:
        engine = load(engine_dir, options)
    except BaseException:
        if hold is not None:
            hold.release()
        raise
    tokenizer, vocab_size = engine.tokenizer, engine.limits.vocab_size
    if tokenizer is not None and vocab_size is not None and tokenizer.max_token_id >= vocab_size:
        logger.warning("%s makes token ids up to %d, outside the model's vocabulary of %d: prompts holding those "
                       "tokens are refused; rebuild the engine with the model's own tokenizer",
                       engine_dir / TOKENIZER_JSON, tokenizer.max_token_id, vocab_size)
    return engine, (time.perf_counter() - start) * 1000, hold, default_params, engine_dir, chat_template_files


def _engine_thread(llm_ref: weakref.ref[LLM]) -> None:
    """The engine thread: turns while its LLM is there and open, holding it only during a turn."""
    while (llm := llm_ref()) is not None and llm._turn():
        del llm


def _release_engine(engine: Engine, hold: EntryHold | None) -> None:
    """Free a closed (or collected) LLM's engine and let its cache entry be evicted again."""
    engine.close()
    if hold is not None:
        hold.release()


def _model_default_params(engine_dir: Path) -> SamplingParams:
    """What a request given no SamplingParams takes: the sampling defaults of the model's generation_config.json, as
    vLLM's ``LLM.generate`` does (a file SamplingParams refuses is warned of, and SamplingParams()'s taken)."""
    try:
        defaults = sampling_defaults(engine_dir, "auto")
    except KilnError as exc:  # kiln serve --generation-config vllm serves such an engine: only warned of here
        logger.warning("%s; requests given no SamplingParams take SamplingParams()'s defaults", exc)
        return SamplingParams()
    if defaults:
        logger.info("LLM.generate and LLM.chat given no SamplingParams take the sampling defaults of the model's "
                    "generation_config.json, as vLLM's LLM.generate does: %s", described(defaults))
    return SamplingParams(**defaults)


def _prompt_text(prompt: Prompt) -> str | None:
    """A prompt's text (``RequestOutput.prompt``): the text given bare or as vLLM's ``{"prompt": text}``; None for
    token ids."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _per_prompt(params: SamplingParams | abc.Sequence[SamplingParams] | None, count: int,
                default: SamplingParams, what: str = "prompts") -> list[SamplingParams]:
    """The checked copy of the params each of ``count`` prompts (``what`` they are) takes: one SamplingParams for
    all, or one each."""
    given = params if isinstance(params, abc.Sequence) else [params] * count
    if len(given) != count:
        raise ValueError(f"got {count} {what} but {len(given)} SamplingParams: pass one, or one per "
                         f"{what.removesuffix('s')}")
    return [_taken(sp, default) for sp in given]


def _sample(params: SamplingParams, number: int) -> SamplingParams:
    """The params of sample ``number`` of a prompt: one completion, seeded ``seed + number`` when seeded."""
    if params.n == 1:
        return params
    return replace(params, n=1, seed=sample_seed(params.seed, number))


def _grouped(outputs: list[RequestOutput], samples: list[int]) -> list[RequestOutput]:
    """One output per prompt from its ``samples[i]`` requests' outputs, in order: the first, holding all as its
    ``outputs``."""
    grouped, start = [], 0
    for count in samples:
        first = outputs[start]
        if count > 1:
            first = replace(first, outputs=[out.completion(i) for i, out in enumerate(outputs[start:start + count])])
        grouped.append(first)
        start += count
    return grouped


def _one_of(params: SamplingParams | abc.Sequence[SamplingParams] | None,
            sampling_params: SamplingParams | abc.Sequence[SamplingParams] | None
            ) -> SamplingParams | abc.Sequence[SamplingParams] | None:
    """The SamplingParams given as ``params`` or by vLLM's name ``sampling_params`` (not both)."""
    if params is not None and sampling_params is not None:
        raise TypeError("pass SamplingParams once: as params or as sampling_params (vLLM's name), not both")
    return params if sampling_params is None else sampling_params


def _taken(params: SamplingParams | None, default: SamplingParams) -> SamplingParams:
    """The params a request takes: a checked copy (a field changed since construction is checked as the constructor
    checks it, and later changes do not reach the request), or ``default``'s for None."""
    params = default if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams (one, or one per prompt), got {type(params).__name__}")
    return replace(params)


# every LLM not yet closed, closed at interpreter exit: an engine thread left inside a torch call while the
# interpreter shuts down aborts the process ("terminate called without an active exception", exit 134)
_open: weakref.WeakSet[LLM] = weakref.WeakSet()


def _forget_open_llms_in_fork() -> None:
    """A fork inherits every open LLM without its engine thread: neither its exit nor its garbage collector may free
    the parent's engine or release its cache hold (a lock the two processes share)."""
    for llm in list(_open):
        llm._release.detach()
    _open.clear()


os.register_at_fork(after_in_child=_forget_open_llms_in_fork)


@atexit.register
def _close_open_llms() -> None:
    for llm in list(_open):
        with contextlib.suppress(Exception):
            llm.close()
