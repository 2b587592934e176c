"""Test-process set-up shared by every test.

- TRITON_INTERPRET=1 before anything imports triton: Triton reads it when `@triton.jit` decorates a
  kernel, and on a CPU machine interpreted kernels are the only ones that run.
- The CPU compatibility layer, so tests may import SGLang in-process on a machine without a GPU
  (no-op for tests that never import it). Never applied when a CUDA device is present.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if not _has_cuda():
    from sglang_swift.cpu_compat import activate_in_process

    activate_in_process()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama (built once per checkout under artifacts/, deterministic from seed 0)."""
    from integration.harness import tiny_model_dir

    return tiny_model_dir()
