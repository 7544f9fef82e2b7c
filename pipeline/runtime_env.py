"""The runtime's options at the CLI's edge: the one place where ``KILN_*`` variables meet them. A command builds its
``RuntimeOptions`` here, from its own flags and, for what it has no flag for, the environment; everything below the
CLI takes the object.

- ``KILN_KERNELS``: ``triton`` (default) or ``torch`` (``RuntimeOptions.kernels``)
- ``KILN_CUDA_GRAPHS``: ``1`` or ``0`` (default: on where the Triton kernels run)
- ``KILN_CUDA_GRAPH_CAPTURE``: ``deferred`` or ``at_load`` (default: deferred on one GPU, at load for tensor parallel)
- ``KILN_OVERLAP_STEPS``: ``1`` or ``0`` (default: on a GPU only)
- ``KILN_PDL``: ``1`` (default) or ``0``
- ``KILN_ATTENTION_FP8_PV``: ``1`` (default) or ``0`` (decode attention's p @ v in FP8 over an FP8 cache)
- ``KILN_LINEAR_MAX_M``: a positive integer (default: the crossover each engine's build measured)
- ``KILN_GPU_MEMORY_UTILIZATION``: a number in (0, 1] (default 0.9)
- ``KILN_SCHEDULER_POLICY``: ``max_utilization`` or ``guaranteed_no_evict`` (default: the backend's own)
- ``KILN_PREFIX_CACHING``: ``1`` (default) or ``0`` (reuse the KV of prompt prefixes earlier requests computed)

``KNOWN_VARIABLES`` names every ``KILN_*`` variable Kiln reads, these and those read elsewhere; every command warns of
any other (``unknown_variables``), a misspelt one being otherwise silently ignored.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from kiln.runtime.options import (
    GRAPH_CAPTURES,
    KERNELS,
    SCHEDULER_POLICIES,
    RuntimeOptions,
    RuntimeOptionsError,
    is_ascii_number,
)

SWITCHES = {"cuda_graphs": "KILN_CUDA_GRAPHS", "overlap_steps": "KILN_OVERLAP_STEPS", "pdl": "KILN_PDL",
            "attention_fp8_pv": "KILN_ATTENTION_FP8_PV", "prefix_caching": "KILN_PREFIX_CACHING"}
# Every RuntimeOptions field a KILN_* variable sets (runtime_options), and its variable, in the order a bench report
# lists them (pipeline/bench/provenance.py)
OPTION_VARIABLES = {"scheduler_policy": "KILN_SCHEDULER_POLICY",
                    "gpu_memory_utilization": "KILN_GPU_MEMORY_UTILIZATION", "kernels": "KILN_KERNELS",
                    "linear_max_m": "KILN_LINEAR_MAX_M", "cuda_graph_capture": "KILN_CUDA_GRAPH_CAPTURE", **SWITCHES}
# Every KILN_* variable Kiln reads (tests/test_kiln_variables.py checks this against the source): the runtime's
# options, read here; the engine cache and its remote (pipeline/config.py); kiln serve's key and log settings
# (pipeline/serve_flags.py, serve_command.py); the tensor-parallel store's port (runtime/native/parallel/group.py);
# the path a Python process of Kiln's own starts with (runtime/kiln_python.py).
KNOWN_VARIABLES = frozenset({*OPTION_VARIABLES.values(), "KILN_CACHE", "KILN_CACHE_REMOTE", "KILN_API_KEY",
                             "KILN_LOG_LEVEL", "KILN_LOGGING_CONFIG_PATH", "KILN_TP_PORT", "KILN_SYS_PATH"})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``KILN_*`` variable of ``environ`` that Kiln does not read (a misspelling: the setting it
    meant is left at its default), naming the known one it is closest to where one is close."""
    known = {name.removeprefix("KILN_"): name for name in KNOWN_VARIABLES}  # the prefix they share is no likeness
    warnings = []
    for name in sorted(n for n in environ if n.upper().startswith("KILN_") and n not in KNOWN_VARIABLES):
        # a typo, not another name that extends a known one (KILN_CACHE_REMOTE_ENDPOINT is no KILN_CACHE_REMOTE)
        close = difflib.get_close_matches(name[5:].upper(), known, n=1, cutoff=0.8)
        fix = f"did you mean {known[close[0]]}?" if close else "unset it"
        warnings.append(f"{name} is not a variable Kiln reads, so it changes nothing; {fix}")
    return warnings


def runtime_options(environ: Mapping[str, str], *, device: str | None = None, num_kv_blocks: int | None = None,
                    gpu_memory_utilization: float | None = None, engine_process: bool = False,
                    prefix_caching: bool | None = None) -> RuntimeOptions:
    """``RuntimeOptions`` from a command's flags and the ``KILN_*`` variables of ``environ`` (a flag wins); a bad value
    is refused naming its variable."""
    values: dict = {"device": device, "num_kv_blocks": num_kv_blocks, "engine_process": engine_process}
    if prefix_caching is not None:
        values["prefix_caching"] = prefix_caching
    if gpu_memory_utilization is None and "KILN_GPU_MEMORY_UTILIZATION" in environ:
        text = environ["KILN_GPU_MEMORY_UTILIZATION"]
        try:
            gpu_memory_utilization = float(text)
        except ValueError:
            gpu_memory_utilization = float("nan")
        if not 0 < gpu_memory_utilization <= 1:
            raise RuntimeOptionsError(f"KILN_GPU_MEMORY_UTILIZATION={text!r} must be a number in (0, 1]; unset it "
                                      f"for 0.9")
    values["gpu_memory_utilization"] = gpu_memory_utilization
    if "KILN_KERNELS" in environ:
        values["kernels"] = _choice(environ, "KILN_KERNELS", KERNELS)
    if "KILN_SCHEDULER_POLICY" in environ:
        values["scheduler_policy"] = _choice(environ, "KILN_SCHEDULER_POLICY", SCHEDULER_POLICIES)
    if "KILN_CUDA_GRAPH_CAPTURE" in environ:
        values["cuda_graph_capture"] = _choice(environ, "KILN_CUDA_GRAPH_CAPTURE", GRAPH_CAPTURES)
    for field, name in SWITCHES.items():
        if name in environ and field not in values:
            values[field] = _choice(environ, name, ("0", "1")) == "1"
    if "KILN_LINEAR_MAX_M" in environ:
        text = environ["KILN_LINEAR_MAX_M"]
        if not is_ascii_number(text) or int(text) < 1:
            raise RuntimeOptionsError(f"KILN_LINEAR_MAX_M={text!r} must be a positive integer; unset it for the "
                                      f"crossover each engine measured")
        values["linear_max_m"] = int(text)
    if values.get("cuda_graphs") and values.get("kernels") == "torch":
        raise RuntimeOptionsError("KILN_CUDA_GRAPHS=1 needs KILN_KERNELS=triton (the reference attention reads "
                                  "lengths on the host and cannot be captured): unset KILN_KERNELS, or set "
                                  "KILN_CUDA_GRAPHS=0")
    return RuntimeOptions(**values)


def _choice(environ: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    value = environ[name]
    if value not in allowed:
        raise RuntimeOptionsError(f"{name}={value!r} must be one of {', '.join(allowed)}; unset it for the default")
    return value
