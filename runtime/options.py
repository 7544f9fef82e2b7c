"""How a loaded engine runs: one typed object that ``LLM.load``, ``kiln serve``, ``kiln bench`` and the native builder
take explicitly. Nothing in the runtime reads the environment: the CLI fills these from its flags and ``KILN_*``
variables (docs/runtime.md), a service that embeds Kiln passes them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from kiln.runtime.errors import KilnError

Kernels = Literal["triton", "torch"]
KERNELS: tuple[Kernels, ...] = ("triton", "torch")
SchedulerPolicy = Literal["max_utilization", "guaranteed_no_evict"]
SCHEDULER_POLICIES: tuple[SchedulerPolicy, ...] = ("max_utilization", "guaranteed_no_evict")
GraphCapture = Literal["deferred", "at_load"]
GRAPH_CAPTURES: tuple[GraphCapture, ...] = ("deferred", "at_load")
# the scheduler policy each backend runs when ``RuntimeOptions.scheduler_policy`` is None
DEFAULT_SCHEDULER_POLICY: dict[str, SchedulerPolicy] = {"native": "max_utilization", "trtllm": "guaranteed_no_evict"}
# the settings only a CUDA device uses that ask something of it at any value but this one (a CPU engine refuses
# another); pdl and attention_fp8_pv, on or off, ask a CPU nothing: one environment serves CPUs and GPUs
CUDA_ONLY: dict[str, object] = {"cuda_graphs": False, "cuda_graph_capture": None, "gpu_memory_utilization": None,
                                "linear_max_m": None}


class RuntimeOptionsError(KilnError):
    """Runtime options that contradict each other or that the runtime cannot run."""


@dataclass(frozen=True)
class RuntimeOptions:
    """Settings of a loaded engine; the defaults are what the figures in docs/performance.md were measured with.

    - ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; None loads where the engine was built for (CUDA when it was
      built there and one is present, else the CPU).
    - ``kernels``: ``"triton"`` runs the native engine's Triton kernels on CUDA tensors (paged attention, the KV
      store, RMSNorm, RoPE, SiLU-and-multiply, the weight-streaming linears of small batches); ``"torch"`` runs the
      plain PyTorch references everywhere. CPU tensors always take the references.
    - ``cuda_graphs``: run steps through CUDA graphs on CUDA: decode graphs per batch-size bucket and single-sequence
      prefill graphs per token-count bucket. None: where the Triton kernels run (the reference attention reads
      lengths on the host and cannot be captured, so True with ``kernels="torch"`` is refused).
    - ``cuda_graph_capture``: when those graphs are captured. ``"deferred"``: not at load, so the engine is ready in
      about the time its weights take; each graph is captured by the first step that needs it (that step runs
      eagerly) or while the engine is idle, largest first (``LLM.wait_until_warm`` waits for all). ``"at_load"``:
      every graph during ``LLM.load`` (seconds more), so no step ever pays for a capture. None: deferred on one
      GPU; a tensor-parallel engine captures at load (its ranks capture together) and refuses ``"deferred"``.
    - ``overlap_steps``: queue the next step on the device before reading the current step's tokens, so the host's
      scheduling overlaps the device's work. None: on a GPU only; on a CPU the step queued ahead runs before the
      current step's tokens are returned, which delays every token by a step (True still turns it on there).
    - ``pdl``: launch the Triton kernels of small batches (up to 16 tokens) with programmatic dependent launch on
      compute capability 9.0 and later.
    - ``attention_fp8_pv``: decode attention over an FP8 KV cache multiplies the probabilities by V in FP8 (E4M3
      probabilities, as TensorRT-LLM's Hopper decode kernel does over an FP8 cache): decode steps about 3 % faster
      on an H200, and the attention output's relative error 2.4e-2 instead of 1.7e-3 (the FP8 cache's own rounding
      is 3.9e-2; docs/performance.md). False keeps that product in float16. No effect on other caches.
    - ``linear_max_m``: the most tokens a quantized linear sends to its weight-streaming kernel, for every shape;
      None follows the crossover the engine's build measured per shape.
    - ``num_kv_blocks``: the KV pool's size in blocks; None sizes it from free memory.
    - ``gpu_memory_utilization``: the share of a GPU's memory the native engine may hold in all (weights, KV pool,
      activations, graphs), as vLLM's option of that name; the KV pool takes what the rest leaves. None: 0.9.
    - ``scheduler_policy``: how requests are admitted into the running batch, TensorRT-LLM's two capacity policies.
      ``"max_utilization"`` admits a request when its prompt fits the free KV blocks and preempts (by recompute)
      when the running ones outgrow the pool, as vLLM does; ``"guaranteed_no_evict"`` admits it only when the pool
      also holds every running request grown to its ``max_tokens``, so none is ever preempted. None: the backend's
      own default (native: max_utilization; TensorRT-LLM: guaranteed_no_evict).
    - ``engine_process``: run the engine in a child process of its own, so that its host work (scheduling, sampling,
      detokenization, kernel launches) and this process's own Python (an HTTP server's event loop, a service that
      embeds Kiln) do not take turns on one GIL; ``LLM`` behaves the same either way. False runs it on a thread of
      this process.
    - ``prefix_caching``: reuse the KV blocks of a prompt prefix an earlier request computed (as vLLM's
      ``enable_prefix_caching``, on by default). False computes every prompt whole, so a request's output never
      depends on what ran before it (benchmarks, bit-reproducibility between a hit and a miss); the engine then
      looks nothing up, and its prefix-cache statistics stay at zero queries and zero hits, as vLLM's do.
    - ``tp_rendezvous``: ``"HOST:PORT"`` where this process, rank 0 of a tensor-parallel engine, meets ranks that
      were started elsewhere (``torchrun`` across hosts; docs/runtime.md). None: rank 0 starts them on this host.
    """

    device: str | None = None
    kernels: Kernels = "triton"
    cuda_graphs: bool | None = None
    cuda_graph_capture: GraphCapture | None = None
    overlap_steps: bool | None = None
    pdl: bool = True
    attention_fp8_pv: bool = True
    linear_max_m: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    scheduler_policy: SchedulerPolicy | None = None
    engine_process: bool = False
    prefix_caching: bool = True
    tp_rendezvous: str | None = None

    def __post_init__(self) -> None:
        for name in ("overlap_steps", "pdl", "attention_fp8_pv", "engine_process", "prefix_caching", "cuda_graphs"):
            value = getattr(self, name)
            optional = name in ("cuda_graphs", "overlap_steps")
            if not isinstance(value, bool) and not (optional and value is None):
                raise RuntimeOptionsError(f"{name} {value!r} must be True or False"
                                          f"{', or None for the default' if optional else ''}")
        if self.kernels not in KERNELS:
            raise RuntimeOptionsError(f"kernels {self.kernels!r} must be one of {', '.join(KERNELS)}")
        share = self.gpu_memory_utilization
        if share is not None and (isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1):
            raise RuntimeOptionsError(f"gpu_memory_utilization {share!r} must be a number in (0, 1], the share of "
                                      f"the GPU's memory the engine may hold")
        if self.scheduler_policy not in (None, *SCHEDULER_POLICIES):
            raise RuntimeOptionsError(f"scheduler_policy {self.scheduler_policy!r} must be one of "
                                      f"{', '.join(SCHEDULER_POLICIES)}, or None for the backend's default")
        if self.cuda_graph_capture not in (None, *GRAPH_CAPTURES):
            raise RuntimeOptionsError(f"cuda_graph_capture {self.cuda_graph_capture!r} must be one of "
                                      f"{', '.join(GRAPH_CAPTURES)}, or None for the engine's default")
        if self.cuda_graphs and self.kernels != "triton":
            raise RuntimeOptionsError("cuda_graphs needs the Triton kernels (the reference attention reads lengths "
                                      "on the host and cannot be captured): use kernels 'triton', or turn CUDA "
                                      "graphs off")
        for name in ("linear_max_m", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise RuntimeOptionsError(f"{name} {value!r} must be a positive integer, or None for the default")
        if self.tp_rendezvous is not None and not _is_host_port(self.tp_rendezvous):
            raise RuntimeOptionsError(f"tp_rendezvous {self.tp_rendezvous!r} must be 'HOST:PORT'")
        if self.device is not None and not _is_device(self.device):
            raise RuntimeOptionsError(f"device {self.device!r} must be 'cpu', 'cuda' or 'cuda:N', or None for the "
                                      f"engine's own")

    def check_applies(self, device_type: str, tp_size: int) -> None:
        """Refuse options that an engine of ``tp_size`` ranks on a ``device_type`` device would not use: the CUDA
        ones (``CUDA_ONLY``: graphs, the GPU's memory, the streaming crossover) on the CPU, a rendezvous for a
        one-device engine. ``kernels="torch"`` is taken there: it is what the CPU runs."""
        unused = [] if device_type == "cuda" else [
            f"{name}={getattr(self, name)!r}" for name, inert in CUDA_ONLY.items()
            if getattr(self, name) not in (None, inert)]
        if unused:
            raise RuntimeOptionsError(f"{', '.join(unused)}: CUDA settings, and this engine runs on the "
                                      f"{device_type}; leave them unset")
        if self.tp_rendezvous is not None and tp_size == 1:
            raise RuntimeOptionsError(f"tp_rendezvous={self.tp_rendezvous!r}: this engine runs on one device "
                                      "(tp_size 1) and meets no other ranks; leave it unset")

    @property
    def captures_cuda_graphs(self) -> bool:
        """Whether CUDA graphs are captured when the engine runs on CUDA."""
        return self.kernels == "triton" if self.cuda_graphs is None else self.cuda_graphs

    def changed(self, *names: str) -> list[str]:
        """Those of ``names`` (default: every field) whose value is not the default, as ``name=value``."""
        defaults = RuntimeOptions()
        return [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                if (not names or f.name in names) and getattr(self, f.name) != getattr(defaults, f.name)]


def is_ascii_number(text: str) -> bool:
    """Whether ``text`` is a whole number in ASCII digits (``str.isdecimal`` also takes ``١٢``, which ``int`` reads
    as 12)."""
    return text.isascii() and text.isdecimal()


def _is_device(text: str) -> bool:
    kind, colon, index = str(text).partition(":")
    return (kind == "cpu" and not colon) or (kind == "cuda" and (not colon or is_ascii_number(index)))


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and is_ascii_number(port) and 0 < int(port) < 65536
