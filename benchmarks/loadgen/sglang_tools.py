"""SGLang's own benchmark tools, run unchanged against a server (SwiftCache or stock), offline.

serving_benchmark: `python -m sglang.benchmark.serving` (in the sglang wheel). The prompts are
  generated token ids read with a local tokenizer, so nothing is downloaded:
    "random-ids"               single requests of random token ids (--backend sglang, /generate)
    "generated-shared-prefix"  multi-turn chat: groups of prompts sharing a system prompt, each
                               conversation `turns` turns long (--backend sglang-oai-chat: SGLang's
                               multi-turn mode speaks only the chat API)
multiturn_benchmark: `benchmark/hicache/bench_multiturn.py`, SGLang's multi-turn benchmark for
  HiCache. It is in SGLang's source repository, not in the wheel: pass the path of a checkout's copy
  (tag v0.5.23). MULTITURN_IMPORTS lists what it imports; `missing_multiturn_imports()` checks them
  against the installed sglang. `--disable-random-sample` makes it use random token ids (the
  default samples ShareGPT, a download).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

DATASET_BACKEND = {"random-ids": "sglang", "generated-shared-prefix": "sglang-oai-chat"}
# what benchmark/hicache/bench_multiturn.py (sglang v0.5.23) imports from sglang
MULTITURN_IMPORTS = {
    "sglang.bench_serving": ("RequestFuncOutput",),
    "sglang.benchmark.datasets.random": ("sample_random_requests",),
    "sglang.benchmark.utils": ("get_tokenizer",),
    "sglang.test.kits.cache_hit_kit": ("async_request_sglang_generate",
                                       "async_request_openai_chat_completions",
                                       "gen_payload", "gen_payload_openai"),
}


def _offline_env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def serving_command(base_url: str, model: str, out_file: str | os.PathLike, *,
                    dataset: str = "random-ids", num_prompts: int = 8, request_rate: float = 4.0,
                    input_len: int = 64, output_len: int = 8, turns: int = 3, groups: int = 2,
                    seed: int = 0) -> list[str]:
    """The `python -m sglang.benchmark.serving` command line for one run (see the module
    docstring)."""
    if dataset not in DATASET_BACKEND:
        raise ValueError(f"dataset {dataset!r}: use one of {sorted(DATASET_BACKEND)} "
                         f"(both need no download)")
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", DATASET_BACKEND[dataset],
           "--base-url", base_url, "--model", model, "--tokenizer", model,
           "--dataset-name", dataset,
           "--num-prompts", str(num_prompts), "--request-rate", str(request_rate),
           "--output-file", str(out_file), "--disable-tqdm", "--seed", str(seed)]
    if dataset == "random-ids":
        cmd += ["--random-input-len", str(input_len), "--random-output-len", str(output_len),
                "--random-range-ratio", "1.0"]
    else:
        cmd += ["--gsp-num-groups", str(groups),
                "--gsp-prompts-per-group", str(max(1, num_prompts // groups)),
                "--gsp-system-prompt-len", str(input_len),
                "--gsp-question-len", str(max(1, input_len // 4)),
                "--gsp-output-len", str(output_len), "--gsp-num-turns", str(turns)]
    return cmd


def serving_benchmark(base_url: str, model: str, out_file: str | os.PathLike,
                      timeout_s: float = 600.0, **kw) -> dict:
    """Run SGLang's serving benchmark; return its result record (the last line of `out_file`).

    Raises RuntimeError with the tool's output tail when it fails or writes no result."""
    Path(out_file).unlink(missing_ok=True)
    proc = subprocess.run(serving_command(base_url, model, out_file, **kw), capture_output=True,
                          text=True, env=_offline_env(), timeout=timeout_s)
    lines = Path(out_file).read_text().splitlines() if Path(out_file).exists() else []
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"sglang.benchmark.serving exited {proc.returncode}; output tail:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1])


def missing_multiturn_imports() -> list[str]:
    """Names bench_multiturn.py imports that the installed sglang lacks ([] = it can run)."""
    missing = []
    for module, names in MULTITURN_IMPORTS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            missing += [f"{module}.{n}" for n in names]
            continue
        missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    return missing


def multiturn_command(script: str | os.PathLike, base_url: str, model: str,
                      log_file: str | os.PathLike, *, clients: int = 4, rounds: int = 3,
                      request_length: int = 64, output_length: int = 8, request_rate: float = 4.0,
                      max_parallel: int = 4, seed: int = 0) -> list[str]:
    """The command line of one bench_multiturn.py run at one rate, on random token ids."""
    url = urlparse(base_url)
    return [sys.executable, str(script), "--host", url.hostname, "--port", str(url.port),
            "--model-path", model, "--num-clients", str(clients), "--num-rounds", str(rounds),
            "--request-length", str(request_length),
            "--output-length", str(output_length), "--request-rate", str(request_rate),
            "--max-parallel", str(max_parallel), "--disable-random-sample", "--disable-auto-run",
            "--log-file", str(log_file), "--seed", str(seed)]


def multiturn_benchmark(script: str | os.PathLike, base_url: str, model: str,
                        log_file: str | os.PathLike, timeout_s: float = 600.0, **kw) -> dict:
    """Run bench_multiturn.py; return its last JSONL record. Raises RuntimeError naming what
    failed."""
    if not Path(script).is_file():
        raise RuntimeError(f"{script} not found: copy benchmark/hicache/bench_multiturn.py from an "
                           f"SGLang checkout at tag v0.5.23 and pass its path")
    Path(log_file).unlink(missing_ok=True)
    proc = subprocess.run(multiturn_command(script, base_url, model, log_file, **kw),
                          capture_output=True, text=True, env=_offline_env(), timeout=timeout_s)
    lines = Path(log_file).read_text().splitlines() if Path(log_file).exists() else []
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench_multiturn.py exited {proc.returncode}; output tail:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1])
