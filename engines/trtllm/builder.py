"""Build a TensorRT-LLM 1.2.x engine with paged KV and in-flight batching into a (temporary) cache folder.

Steps: preflight (refuse what TensorRT-LLM would only reject at load), convert the HF checkpoint for format none,
run trtllm-build, check that every rank's engine was written, adopt the new timing cache, copy the tokenizer and
write `kiln_trtllm.json`. Each TensorRT-LLM command runs as a subprocess whose output, exit status and time go into
the returned build record; failures raise TrtllmBuildError with the tail of stderr, and keep the full logs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.engines.eos import stopping_eos_ids
from kiln.engines.trtllm.command import BUILD_DIR_PLACEHOLDER, NEW_TIMING_CACHE, convert_command, trtllm_build_command
from kiln.engines.trtllm.options import TrtllmBuildOptions
from kiln.engines.trtllm.preflight import preflight
from kiln.engines.trtllm.process import ProcessRecord, TrtllmBuildError, run_logged
from kiln.runtime.tokenizer_files import copy_tokenizer_files
from kiln.runtime.trtllm.engine_info import TrtllmEngineInfo

LOG_DIR = "logs"
SCRATCH_DIR = ".kiln-scratch"
FAILED_LOGS = "failed"


def plan_trtllm_build(options: TrtllmBuildOptions, *, quant_format: str, kv_cache_dtype: str, model_dtype: str,
                      fingerprint: dict[str, Any] | None, timing_cache: Path, hf_dir: Path | None,
                      trtllm_checkpoint_dir: Path | None, out_dir: Path = BUILD_DIR_PLACEHOLDER,
                      executable: str = "trtllm-build", python: str = sys.executable) -> dict[str, Any]:
    """What `build_trtllm_engine` would run, for `kiln build --dry-run`: preflight first (TrtllmPreflightError on a
    refusal), then the exact argv of trtllm-build (and of the conversion, for format none). The build folder is a
    temporary one named at build time, shown as `<build-dir>`; paths that do not exist yet are shown as planned."""
    config_path = trtllm_checkpoint_dir / "config.json" if trtllm_checkpoint_dir else None
    checkpoint_config = _read_json(config_path) if config_path else None
    warnings = preflight(options, quant_format, kv_cache_dtype, fingerprint, checkpoint_config)
    convert = None
    if quant_format == "none":
        _check_convertible(hf_dir)
        trtllm_checkpoint_dir = out_dir / SCRATCH_DIR / "checkpoint"
        convert = convert_command(hf_dir or Path("<model-dir>"), trtllm_checkpoint_dir, options, dtype=model_dtype,
                                  python=python)
    command = trtllm_build_command(trtllm_checkpoint_dir or Path("<quantized-checkpoint>/trtllm"), out_dir, options,
                                   quant_format=quant_format, kv_cache_dtype=kv_cache_dtype, timing_cache=timing_cache,
                                   executable=executable)
    return {"command": command, "convert_command": convert, "preflight_warnings": warnings,
            "timing_cache": str(timing_cache)}


CONVERTIBLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def _check_convertible(hf_dir: Path | None) -> None:
    """Refuse an unquantized checkpoint that ``convert.py`` (TensorRT-LLM's Llama conversion) cannot convert."""
    config = (_read_json(hf_dir / "config.json") if hf_dir is not None else None) or {}
    architecture = (config.get("architectures") or [None])[0]
    if architecture is not None and architecture not in CONVERTIBLE_ARCHITECTURES:
        raise TrtllmBuildError(f"{hf_dir / 'config.json'}: Kiln converts unquantized "
                               f"{', '.join(CONVERTIBLE_ARCHITECTURES)} checkpoints for TensorRT-LLM, not "
                               f"{architecture}; quantize it (quantize.format fp8 or int4_awq: modelopt exports it for "
                               f"TensorRT-LLM) or use --backend native")


def build_trtllm_engine(out_dir: Path, options: TrtllmBuildOptions, *, hf_dir: Path, quant_format: str,
                        kv_cache_dtype: str, model_dtype: str, timing_cache: Path, fingerprint: dict[str, Any],
                        timeout_s: float, trtllm_checkpoint_dir: Path | None = None,
                        tokenizer_dir: Path | None = None, executable: str = "trtllm-build",
                        python: str = sys.executable, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Build into `out_dir` (exists, empty) and return the build record.

    `trtllm_checkpoint_dir` is the quantize stage's TensorRT-LLM export; for format none it is None and `hf_dir` is
    converted first. `tokenizer_dir` (the model folder a quantized checkpoint was calibrated from), else `hf_dir`,
    supplies the tokenizer, chat templates, generation config and EOS ids. `fingerprint` is the build machine's
    `trtllm_machine_fingerprint()`; `timeout_s` bounds conversion and build together."""
    deadline = time.monotonic() + timeout_s
    if trtllm_checkpoint_dir is None and quant_format != "none":
        raise TrtllmBuildError(f"quantize.format {quant_format} needs the quantize stage's TensorRT-LLM "
                               f"checkpoint, and none was given; run the quantize stage first")
    if trtllm_checkpoint_dir is not None and not (trtllm_checkpoint_dir / "config.json").is_file():
        raise TrtllmBuildError(f"{trtllm_checkpoint_dir}: the quantized checkpoint has no TensorRT-LLM form "
                               f"(modelopt did not export this model for TensorRT-LLM: its calibration report's notes "
                               f"say why); build it with --backend native")
    plan = plan_trtllm_build(options, quant_format=quant_format, kv_cache_dtype=kv_cache_dtype,
                             model_dtype=model_dtype, fingerprint=fingerprint, timing_cache=timing_cache,
                             hf_dir=hf_dir, trtllm_checkpoint_dir=trtllm_checkpoint_dir, out_dir=out_dir,
                             executable=executable, python=python)  # the same argv the dry run prints
    record: dict[str, Any] = {"backend": "trtllm", "options": options.to_dict(), "convert": None,
                              "warnings": plan["preflight_warnings"]}
    if plan["convert_command"] is not None:
        record["convert"] = _run(plan["convert_command"], "convert-checkpoint", out_dir, deadline, timeout_s, env,
                                 timing_cache).to_dict()
    record["build"] = _run(plan["command"], "trtllm-build", out_dir, deadline, timeout_s, env, timing_cache).to_dict()
    _check_engine_files(out_dir, options, record["build"])
    record["timing_cache"] = _adopt_timing_cache(out_dir / NEW_TIMING_CACHE, timing_cache)
    shutil.rmtree(out_dir / SCRATCH_DIR, ignore_errors=True)
    _write_engine_info(out_dir, options, hf_dir, tokenizer_dir or hf_dir, quant_format, kv_cache_dtype, fingerprint,
                       record)
    return record


def _run(argv: list[str], name: str, out_dir: Path, deadline: float, budget_s: float, env: dict[str, str] | None,
         timing_cache: Path) -> ProcessRecord:
    """Run one command with what is left of the time budget; on failure keep its logs next to the timing cache."""
    log_dir = out_dir / LOG_DIR
    try:
        return run_logged(argv, name=name, log_dir=log_dir, timeout_s=deadline - time.monotonic(), env=env,
                          budget_s=budget_s)
    except TrtllmBuildError as e:
        kept = _keep_failed_logs(log_dir, name, timing_cache.parent / FAILED_LOGS)
        raise TrtllmBuildError(f"{e}; full logs: {kept}*", e.record) from None


def _keep_failed_logs(log_dir: Path, name: str, dest: Path) -> Path:
    """Copy a failed command's logs out of the build folder (which the cache discards) and return their prefix."""
    dest.mkdir(parents=True, exist_ok=True)
    prefix = dest / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{name}"
    for log in log_dir.glob(f"{name}.*.log"):
        shutil.copyfile(log, f"{prefix}.{log.name.split('.', 1)[1]}")
    return prefix


def _check_engine_files(out_dir: Path, options: TrtllmBuildOptions, build: dict) -> None:
    missing = [name for name in ["config.json", *(f"rank{r}.engine" for r in range(options.world_size))]
               if not (out_dir / name).is_file()]
    if missing:
        last = (build["stderr_tail"] or build["stdout_tail"] or "nothing").strip().splitlines()[-1]
        raise TrtllmBuildError(f"trtllm-build exited 0 but did not write {', '.join(missing)}; its last output: "
                               f"{last}", build)


def _adopt_timing_cache(new_cache: Path, timing_cache: Path) -> str | None:
    """Move the timing cache trtllm-build wrote over the shared one (one rename: readers never see half a file)."""
    if not new_cache.is_file() or new_cache.stat().st_size == 0:
        new_cache.unlink(missing_ok=True)
        return None
    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    staged = timing_cache.with_name(f".{timing_cache.name}.{os.getpid()}.tmp")
    shutil.move(new_cache, staged)
    os.replace(staged, timing_cache)
    return str(timing_cache)


def _write_engine_info(out_dir: Path, options: TrtllmBuildOptions, hf_dir: Path, tokenizer_dir: Path,
                       quant_format: str, kv_cache_dtype: str, fingerprint: dict[str, Any],
                       record: dict[str, Any]) -> None:
    copy_tokenizer_files(tokenizer_dir, out_dir)
    hf_config = _read_json(hf_dir / "config.json") or {}
    generation = _read_json(tokenizer_dir / "generation_config.json") or {}
    TrtllmEngineInfo(
        plan=replace(options.plan, kv_cache_dtype=kv_cache_dtype),
        quantization={"format": quant_format, "kv_cache_dtype": kv_cache_dtype},
        fingerprint={k: fingerprint.get(k) for k in ("device", "gpu_name", "compute_capability", "cuda",
                                                     "tensorrt_llm", "tensorrt")},
        eos_token_ids=stopping_eos_ids(tokenizer_dir, hf_config, generation),
        vocab_size=int(hf_config.get("vocab_size", 0)),
        tp_size=options.tp_size, pp_size=options.pp_size,
        build={"argv": record["build"]["argv"], "convert_argv": (record["convert"] or {}).get("argv")},
    ).save(out_dir)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrtllmBuildError(f"{path}: unreadable ({e}); re-export the checkpoint") from None
