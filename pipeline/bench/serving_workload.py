"""What ``kiln loadtest`` sends: the requests (a prompt and how many tokens to generate each) and when each arrives.

Prompts are one text for every request (``--prompt``), seeded random token ids of ``--input-len`` tokens, or the lines
of a prompts file; ``--spread`` varies the input and output lengths drawn, as serving benchmarks draw them (a text
prompt's output lengths only; a prompts file sets its own). Arrivals follow a Poisson process at ``--request-rate``
requests per second, or all come at once (``inf``); ``--concurrency`` caps how many are in flight either way. The
first ``--warmup`` requests run before the measurement and are not counted.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kiln.runtime.errors import InvalidRequestError, KilnError
from kiln.runtime.limits import EngineLimits, RequestTooLongError
from kiln.runtime.sampling_params import SamplingParams

Prompt = str | list[int]


class WorkloadError(KilnError):
    """A workload that cannot be made from the options given (a missing file, a length the server cannot take)."""


@dataclass(frozen=True)
class ServingRequest:
    """One request: its prompt (text, or token ids sent as they are), the tokens it generates (EOS ignored), and,
    for a client that goes away mid-stream, after how many streamed pieces of output it disconnects."""

    prompt: Prompt
    max_tokens: int
    disconnect_after: int | None = None


@dataclass(frozen=True)
class ServingWorkload:
    """The measured requests, the warm-up requests before them, and each measured request's arrival time in seconds
    after the first (all 0.0: every request arrives at once)."""

    requests: list[ServingRequest]
    warmup: list[ServingRequest]
    arrivals_s: list[float]

    @property
    def uses_token_ids(self) -> bool:
        return any(not isinstance(r.prompt, str) for r in self.requests)

    def to_json(self) -> dict:
        """The workload as a JSON object (``from_json`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ServingWorkload:
        return cls(requests=[ServingRequest(**r) for r in data["requests"]],
                   warmup=[ServingRequest(**r) for r in data["warmup"]], arrivals_s=data["arrivals_s"])


def lengths(mean: int, spread: float, count: int, rng: random.Random) -> list[int]:
    """``count`` lengths uniform in ``mean * (1 ± spread)``, at least 1."""
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return [rng.randint(low, high) for _ in range(count)]


def arrivals(count: int, request_rate: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process at ``request_rate`` per second (exponential gaps), from 0; all 0.0 for an
    infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


def make_workload(*, requests: int, warmup: int, request_rate: float, seed: int, prompt: str | None = None,
                  max_tokens: int | None = None, input_len: int | None = None, output_len: int | None = None,
                  spread: float = 0.0, vocab_size: int | None = None, prompts_file: Path | None = None,
                  disconnect: float = 0.0) -> ServingWorkload:
    """The workload of the loadtest options: random token ids when ``input_len`` is given (``vocab_size`` bounds
    them), else the prompts file's prompts in turn, else ``prompt`` for every request; ``spread`` varies the lengths
    drawn (a text prompt's ``max_tokens``). A ``disconnect`` share of the measured requests, drawn at random, goes
    away after a random part of its output."""
    rng = random.Random(seed)
    count = requests + warmup
    if spread and prompts_file is not None:
        raise WorkloadError(f"--spread varies --input-len and --output-len, and --prompts-file {prompts_file} sets "
                            f"the prompts and their max_tokens itself: leave out --spread")
    if input_len is not None:
        if vocab_size is None:
            raise WorkloadError("--input-len draws random token ids, which needs the engine's vocabulary size: pass "
                                "--vocab-size, or test a Kiln server (its /v1/models says it)")
        outputs = lengths(output_len or max_tokens or 128, spread, count, rng)
        drawn = [ServingRequest([rng.randrange(vocab_size) for _ in range(n)], out)
                 for n, out in zip(lengths(input_len, spread, count, rng), outputs, strict=True)]
    elif prompts_file is not None:
        drawn = _from_file(prompts_file, count, max_tokens or output_len or 128)
    else:
        drawn = [ServingRequest(prompt or "Once upon a time", out)
                 for out in lengths(max_tokens or output_len or 128, spread, count, rng)]
    times = arrivals(requests, request_rate, rng)
    measured = drawn[warmup:]
    if disconnect:
        measured = [replace(r, disconnect_after=rng.randint(1, r.max_tokens - 1))
                    if rng.random() < disconnect and r.max_tokens > 1 else r for r in measured]
    return ServingWorkload(requests=measured, warmup=drawn[:warmup], arrivals_s=times)


def with_fresh_token_ids(workload: ServingWorkload, vocab_size: int, seed: int) -> ServingWorkload:
    """The same workload (lengths, max_tokens, arrivals, disconnects) with new seeded random token ids below
    ``vocab_size`` in each token-id prompt, so that running it again finds none of the first run's prompts in the
    prefix cache; text prompts stay as they are."""
    rng = random.Random(seed)

    def fresh(request: ServingRequest) -> ServingRequest:
        if isinstance(request.prompt, str):
            return request
        return replace(request, prompt=[rng.randrange(vocab_size) for _ in request.prompt])

    return replace(workload, requests=[fresh(r) for r in workload.requests], warmup=[fresh(r) for r in workload.warmup])


def text_prompts(workload: ServingWorkload) -> set[str]:
    """The distinct text prompts of the workload, warm-up included."""
    return {r.prompt for r in (*workload.warmup, *workload.requests) if isinstance(r.prompt, str)}


def check_fits(workload: ServingWorkload, limits: EngineLimits, text_tokens: dict[str, int] | None = None) -> None:
    """Refuse, before anything is sent, a workload with a request the engine can never serve: a prompt over its
    max_input_len, or a prompt and its max_tokens over its context. A text prompt is counted as ``text_tokens``
    gives it (the server's ``/tokenize``); one not counted there only has its max_tokens checked."""
    text_tokens = text_tokens or {}
    for request in (*workload.warmup, *workload.requests):
        if isinstance(request.prompt, str) and request.prompt not in text_tokens:
            if request.max_tokens >= limits.max_request_tokens:
                raise WorkloadError(f"the workload's requests do not fit this engine: max_tokens "
                                    f"({request.max_tokens}) leaves no room for a prompt in its context of "
                                    f"{limits.max_request_tokens} tokens (max_seq_len, or its KV pool where smaller): "
                                    f"lower max_tokens")
            continue
        prompt_tokens = text_tokens[request.prompt] if isinstance(request.prompt, str) else len(request.prompt)
        try:
            limits.check_request(prompt_tokens, SamplingParams(max_tokens=request.max_tokens))
        except (RequestTooLongError, InvalidRequestError) as exc:  # too long, or an empty prompt
            raise WorkloadError(f"the workload's requests do not fit this engine: {exc}") from None


def card_limits(card: dict) -> EngineLimits | None:
    """What a server's model card says one request may hold: ``max_model_len`` (as vLLM's card gives it) and Kiln's
    ``max_input_len`` (else one token less); None when it says neither. Its batch bounds are not on the card, and
    ``check_fits`` does not read them: they stand at one request of the whole context."""
    context = card.get("max_model_len")
    if not isinstance(context, int) or context < 2:
        return None
    longest_prompt = card.get("max_input_len") if isinstance(card.get("max_input_len"), int) else context - 1
    return EngineLimits(max_input_len=longest_prompt, max_seq_len=context, max_batch_size=1, max_num_tokens=context)


def _from_file(path: Path, count: int, max_tokens: int) -> list[ServingRequest]:
    """A ``.jsonl`` file of ``{"prompt": text or token ids, "max_tokens": n}`` objects (``max_tokens`` optional), a
    ``.json`` array of such objects, of texts, or of ShareGPT conversations (vLLM's ``--dataset-name sharegpt``
    file: each conversation's first turn, as vLLM samples it, where it has a reply), or a text file of one prompt per
    line; its requests are taken in turn, again from the start if there are too few."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"--prompts-file {path}: unreadable ({exc})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise WorkloadError(f"--prompts-file {path}: no prompts in it; write one per line")
    if Path(path).suffix.lower() == ".json":
        found = _json_requests(path, text, max_tokens)
    elif Path(path).suffix.lower() == ".jsonl":
        found = [_jsonl_request(path, number, line, max_tokens) for number, line in enumerate(lines, 1)]
    else:
        found = [ServingRequest(line, max_tokens) for line in lines]
    return [found[i % len(found)] for i in range(count)]


def _json_requests(path: Path, text: str, max_tokens: int) -> list[ServingRequest]:
    """The requests of a ``.json`` prompts file (``_from_file``)."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"--prompts-file {path}: not JSON ({exc}); a .json file is an array of "
                            f"{{\"prompt\": ...}} objects or of ShareGPT conversations") from None
    if not isinstance(records, list) or not records:
        raise WorkloadError(f"--prompts-file {path}: a .json file is a non-empty array of {{\"prompt\": ...}} objects "
                            f"or of ShareGPT conversations")
    found = []
    for number, record in enumerate(records):
        if isinstance(record, str):
            found.append(ServingRequest(record, max_tokens))
        elif isinstance(record, dict) and isinstance(turns := record.get("conversations"), list):
            first = turns[0].get("value") if turns and isinstance(turns[0], dict) else None
            if len(turns) >= 2 and isinstance(first, str) and first:  # as vLLM samples them: a prompt and its reply
                found.append(ServingRequest(first, max_tokens))
        else:
            found.append(_jsonl_request(path, f"[{number}]", json.dumps(record), max_tokens))
    if not found:
        raise WorkloadError(f"--prompts-file {path}: no conversation in it has a first turn and a reply")
    return found


def _jsonl_request(path: Path, number: int | str, line: str, max_tokens: int) -> ServingRequest:
    try:
        record = json.loads(line)
        prompt = record["prompt"]
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise TypeError("prompt is neither text nor a list of token ids")
        return ServingRequest(prompt, int(record.get("max_tokens", max_tokens)))
    except (ValueError, KeyError, TypeError) as exc:
        raise WorkloadError(f"--prompts-file {path}:{number}: {exc}; each entry is an object with a 'prompt' (text "
                            f"or token ids) and optionally 'max_tokens'") from None
