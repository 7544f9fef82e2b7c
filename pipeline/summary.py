"""The short human summary printed at the end of ``kiln build`` and ``kiln build --dry-run``."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kiln.pipeline.console import stdout


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_plan(plan: dict) -> None:
    """Stages with their action and reason, the backend and the key."""
    table = Table(box=None, show_header=True, header_style="bold")
    for column in ("stage", "action", "reason"):
        table.add_column(column)
    for stage in plan["stages"]:
        style = "green" if stage["action"] == "skip" else "yellow"
        table.add_row(stage["name"], Text(stage["action"], style=style), stage["reason"])
    stdout.print(table)
    stdout.print(f"backend   {plan['backend']} on {plan['device']} ({plan['backend_reason']})", highlight=False)
    stdout.print(f"engine    {plan['engine_key'] or '- (unknown until the model is on disk)'}", highlight=False)


def print_result(result: dict) -> None:
    """Plan, quantization verdict and gate figures, cache hit or miss, load latency and the sample."""
    print_plan(result)
    quant = result.get("quantization")
    if quant:
        shipped = quant.get("format")
        fallback = f" (fell back from {quant['fallback_from']})" if quant.get("fallback_from") else ""
        verdict = UNQUANTIZED if shipped == "none" else \
            f"{_verdict(quant.get('converged'))}; gate {_gate_text(quant.get('gate') or {})}"
        stdout.print(f"quantize  {shipped}{fallback}: {verdict}", highlight=False)
        unsettled = quant.get("unsettled") or []
        if not quant.get("converged") and unsettled:
            named = ", ".join(f"{u['statistic']} ({_fmt(_pct(u['recent_change']), '.1f')}%)" for u in unsettled[:3])
            more = f" and {len(unsettled) - 3} more" if len(unsettled) > 3 else ""
            stdout.print(f"          still moving: {named}{more}", highlight=False)
    cache = result["cache"]
    why = escape(f" ({cache['reason']})") if cache["reason"] != "hit" else ""
    hit = f"[green]hit[/]{why}" if cache["hit"] else f"[yellow]miss[/]{why}"
    saved = ""
    if seconds := result.get("build_seconds_saved"):  # a miss saves what earlier stages found: the calibration
        saved = f", {seconds:.2f} s of {'quantize and build' if cache['hit'] else 'calibration'} saved"
    stdout.print(f"cache     {hit}{saved}", markup=True)
    stdout.print(f"engine    {result['engine_dir']}", highlight=False)
    stdout.print(f"load      {_fmt(result['load_ms'], '.1f')} ms")
    sample = result.get("sample")
    if sample:
        stdout.print(f"sample    {sample['prompt']!r} → {sample['text']!r}", highlight=False)


def _pct(value: float | None) -> float | None:
    return None if value is None else value * 100


def print_quantize(result: dict) -> None:
    """The rounds table, the verdict and the gate figures of ``kiln quantize``."""
    table = Table(box=None, show_header=True, header_style="bold")
    for column in ("round", "samples", "max change", "KL", "top-1"):
        table.add_column(column, justify="right")
    for index, row in enumerate(result["rounds"], start=1):
        table.add_row(str(index), str(row["samples"]), f"{_fmt(_pct(row['max_rel_change']), '.2f')}%",
                      _fmt(row["kl"], ".5f"), f"{_fmt(_pct(row['top1_agreement']), '.1f')}%")
    if result["rounds"]:
        stdout.print(table)
    verdict = UNQUANTIZED if result["format"] == "none" else _verdict(result["converged"])
    fallback = f" (fell back from {result['fallback_from']})" if result.get("fallback_from") else ""
    action = "ran" if result["action"] == "run" else "skipped"
    stdout.print(f"stage     {action}: {result['reason']}", highlight=False)
    stdout.print(f"format    {result['format']}{fallback}: {verdict}", highlight=False)
    if result.get("summary"):
        stdout.print(f"          {result['summary']}", highlight=False)
    gate = result.get("gate")
    if gate and result["format"] != "none":
        stdout.print(f"gate      {_gate_text(gate)}", highlight=False)
    stdout.print(f"checkpoint {result['checkpoint_dir']} (content hash {result['checkpoint_hash'][:16]}…)",
                 highlight=False)


UNQUANTIZED = "unquantized (nothing to calibrate or gate)"


def _verdict(converged: bool | None) -> str:
    return "converged" if converged else "not converged"


def _gate_text(gate: dict) -> str:
    """``passed: ppl +0.02%, KL 4.6e-05, top-1 99.5%`` (FAILED when it failed)."""
    verdict = "not applied" if gate.get("applied") is False else "passed" if gate.get("passed") else "FAILED"
    return (f"{verdict}: ppl {_fmt(_pct(gate.get('ppl_increase')), '+.2f')}%, "
            f"KL {_fmt(gate.get('kl'), '.2g')}, top-1 {_fmt(_pct(gate.get('top1_agreement')), '.1f')}%")
