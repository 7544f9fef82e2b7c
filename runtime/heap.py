"""Keep the garbage collector's full passes short in a process that serves."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect, then exempt every object alive now (imported modules, the loaded engine, the tokenizer) from future
    collections. A full pass otherwise walks that whole heap: 20-40 ms on the 2-core CPU with the tiny model, longer
    with PyTorch's heap, stalling every request in flight. Call it once a process that serves has loaded what it
    keeps, as the process's owner (``kiln serve``, the engine process), not from a library an application embeds."""
    gc.collect()
    gc.freeze()
