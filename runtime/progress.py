"""A progress bar over a batch's requests, on stderr (`LLM.generate`'s and `LLM.chat`'s ``use_tqdm``, as in vLLM)."""

from __future__ import annotations

import time
from concurrent.futures import Future, as_completed

from kiln.runtime.outputs import RequestOutput


def wait_showing_progress(futures: list[Future]) -> None:
    """Return once every request of ``futures`` has finished (or failed), drawing how many have and the output
    tokens/s so far."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("Processed prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[rate]}"))
    start, tokens = time.perf_counter(), 0
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("generate", total=len(futures), rate="")
        for future in as_completed(futures):
            output = None if future.exception() else future.result()
            tokens += len(output.token_ids) if isinstance(output, RequestOutput) else 0
            rate = f"output {tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s"
            progress.update(task, advance=1, rate=rate)
