"""How many tokens per second the serving path can carry, with no model in the way: a scripted engine (the
``Engine`` interface) emits one token per running request per step after waiting ``--step-ms`` (as a host waits for
its GPU, without holding the GIL), through the real Sequence, stop rules and detokenizer of the tiny model's
tokenizer. It is driven by ``kiln loadtest``'s clients, once streaming from ``LLM.stream`` in this process, then
over HTTP from a ``kiln loadtest`` process of its own against the engine served here, on a thread of the server's
process and in an engine process of its own (``RuntimeOptions.engine_process``); the engine's own rate is
``clients x 1000 / step-ms``.

    python tools/serve_ceiling.py [--clients 64] [--requests 256] [--output-len 128] [--step-ms 2.7] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from kiln.pipeline.bench.serving_clients import run_in_process
from kiln.pipeline.bench.serving_workload import make_workload
from kiln.runtime.engine_process import ProcessEngine
from kiln.runtime.limits import EngineLimits
from kiln.runtime.llm import LLM
from kiln.runtime.outputs import RequestFailure, StreamDelta, finish_reason, step_delta
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence, SequenceStatus
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from kiln.runtime.stats import EngineStats
from kiln.runtime.tokenizer import Tokenizer, encode_prompt, request_detokenizer

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"


class ScriptedEngine:
    """Every running request gets a word token each step (the next of the vocabulary's words, which decode to text at
    once, as a trained model's output mostly does), ``step_s`` after the step starts."""

    def __init__(self, step_s: float, max_batch_size: int = 1024) -> None:
        self.step_s = step_s
        self.tokenizer = Tokenizer.from_dir(TINY)
        vocab = self.tokenizer.vocab_size
        self.limits = EngineLimits(max_input_len=4096, max_seq_len=8192, max_batch_size=max_batch_size,
                                   max_num_tokens=8192, vocab_size=vocab)
        self.eos_token_ids: frozenset[int] = frozenset()  # it writes words only: no EOS
        self._words = [i for i in range(vocab) if self.tokenizer.decode([i]).strip().isalpha()]
        self.stats = EngineStats()
        self._running: dict[str, tuple[Sequence, object]] = {}

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        token_ids = encode_prompt(prompt, self.tokenizer, self.limits.vocab_size, bool(params.stop))
        self.limits.check_request(len(token_ids), params)
        return Sequence(request_id, token_ids, params)

    def add_request(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self._running[seq.request_id] = (seq, request_detokenizer(self.tokenizer, seq.prompt_token_ids, seq.params))

    def step(self) -> list[StreamDelta | RequestFailure]:
        time.sleep(self.step_s)
        now, deltas, prompt_tokens = time.monotonic(), [], 0
        for request_id, (seq, detokenizer) in list(self._running.items()):
            token = self._words[(seq.token_ids[-1] + 1) % len(self._words)]
            seq.append_token(token, now)
            prompt_tokens += seq.num_prompt_tokens if seq.num_completion_tokens == 1 else 0
            if (reason := finish_reason(seq, token, detokenizer, self.eos_token_ids, None)) is not None:
                seq.finish(reason, now)
                del self._running[request_id]
            deltas.append(step_delta(seq, detokenizer, [token]))
        self.stats.record_tokens(prompt_tokens, len(deltas))  # vLLM's token counters, as an engine's step counts them
        return deltas

    def abort_request(self, request_id: str) -> StreamDelta | None:
        if request_id not in self._running:
            return None
        seq, detokenizer = self._running.pop(request_id)
        seq.finish("abort")
        return step_delta(seq, detokenizer, [])

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def stats_snapshot(self) -> dict:
        return {**self.stats.snapshot(), "num_running": len(self._running), "num_waiting": 0,
                "kv_cache": {"num_blocks": 0, "block_size": 0, "used_blocks": 0, "free_blocks": 0},  # no KV pool
                "prefix_cache": {"queried_tokens": 0, "hit_tokens": 0, "hit_blocks": 0, "hit_rate": 0.0}}

    def warm_up_step(self) -> bool:
        """Nothing is deferred."""
        return False

    def failure(self) -> None:
        """It never fails."""
        return None

    def interrupt(self) -> bool:
        """Its steps always return."""
        return False

    def close(self) -> None:
        """Nothing to release."""


def served(llm: LLM, args: argparse.Namespace) -> dict:
    """The workload over HTTP, from a loadtest process of its own (so that the clients take no time from the
    server's process); its report has the CPU each process spent per token, from the server's /metrics."""
    with ServerThread(create_app(llm, TINY, ServerSettings(model_name="scripted", max_queue=4096))) as server:
        loadtest = [sys.executable, "-m", "kiln", "loadtest", server.url, "--clients", str(args.clients),
                    "--requests", str(args.requests), "--warmup", str(args.clients), "--input-len",
                    str(args.input_len), "--output-len", str(args.output_len), "--json"]
        run = subprocess.run(loadtest, capture_output=True, text=True, check=True, env=os.environ)
    return json.loads(run.stdout)


def measure(args: argparse.Namespace) -> dict:
    """In this process's event loop, then served with the engine on a thread and in a process of its own."""
    report = {"clients": args.clients, "step_ms": args.step_ms,
              "engine_tokens_per_s": args.clients * 1000 / args.step_ms}
    with LLM(ScriptedEngine(args.step_ms / 1000)) as llm:
        workload = make_workload(requests=args.requests, warmup=args.clients, request_rate=math.inf, seed=0,
                                 input_len=args.input_len, output_len=args.output_len,
                                 vocab_size=llm.limits.vocab_size)
        report["in_process"] = asyncio.run(run_in_process(llm, workload, concurrency=args.clients))
        report["served_engine_thread"] = served(llm, args)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    with LLM(ProcessEngine("serve_ceiling:ScriptedEngine", {"step_s": args.step_ms / 1000})) as llm:
        report["served_engine_process"] = served(llm, args)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=2.7, help="a decode step of the 8B FP8 engine at batch 64")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = measure(args)
    engine = report["engine_tokens_per_s"]
    for name in ("in_process", "served_engine_thread", "served_engine_process"):
        r = report[name]
        print(f"{name:21}  {r['output_tokens_per_s']:9,.0f} tokens/s ({r['output_tokens_per_s'] / engine:.0%} of the "
              f"engine's {engine:,.0f})  TTFT p50/p99 {r['ttft_ms']['p50']:.1f}/{r['ttft_ms']['p99']:.1f} ms  "
              f"ITL p50/p99 {r['itl_ms']['p50']:.2f}/{r['itl_ms']['p99']:.2f} ms  {r['tokens_per_event']:.2f} "
              f"tokens/event  CPU µs/token {r.get('server', {}).get('cpu_us_per_token', '-')}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
