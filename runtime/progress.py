"""A progress bar over a batch's requests, on stderr (`LLM.generate`'s and `LLM.chat`'s ``use_tqdm``, as vLLM
draws it: with tqdm, which also draws in a notebook)."""

from __future__ import annotations

import time
from concurrent.futures import Future, as_completed

from kiln.runtime.outputs import RequestOutput


def wait_showing_progress(futures: list[Future]) -> None:
    """Return once every request of ``futures`` has finished (or failed), drawing how many have and the output
    tokens/s so far."""
    from tqdm import tqdm

    start, tokens = time.perf_counter(), 0
    with tqdm(total=len(futures), desc="Processed prompts", dynamic_ncols=True) as bar:
        for future in as_completed(futures):
            output = None if future.exception() else future.result()
            tokens += len(output.token_ids) if isinstance(output, RequestOutput) else 0
            bar.set_postfix_str(f"output {tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s", refresh=False)
            bar.update(1)
