"""A progress bar over a batch's requests, on stderr (`LLM.generate`'s and `LLM.chat`'s ``use_tqdm``, as vLLM
draws it: with tqdm, which also draws in a notebook, or with the tqdm-like class the caller passes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, as_completed
from typing import Any

from kiln.runtime.outputs import RequestOutput


def wait_showing_progress(futures: list[Future], bar_class: Callable[..., Any] | None = None) -> None:
    """Return once every request of ``futures`` has finished, or one has failed (the bar stops there), drawing how
    many have finished and the output tokens/s so far with ``bar_class`` (tqdm's own by default; any class taking
    tqdm's arguments, with ``update`` and ``close``, as vLLM takes one)."""
    if bar_class is None:
        from tqdm import tqdm as bar_class

    start, tokens = time.perf_counter(), 0
    bar = bar_class(total=len(futures), desc="Processed prompts", dynamic_ncols=True)
    try:
        for future in as_completed(futures):
            if future.exception() is not None:  # the batch fails with it: no bar claims its prompts processed
                return
            output = future.result()
            tokens += len(output.token_ids) if isinstance(output, RequestOutput) else 0
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(f"output {tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s",
                                    refresh=False)
            bar.update(1)
    finally:
        bar.close()
