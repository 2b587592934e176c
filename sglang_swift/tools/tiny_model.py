"""A tiny Llama-architecture model with a locally trained tokenizer; no hub access needed.

CLI: `python scripts/build_tiny_model.py --out artifacts/tiny-llama [--seed 0]`.

The tokenizer is a byte-level BPE trained on Python's own standard-library sources (present on every
machine with Python), with ChatML-style special tokens and chat template. The weights are randomly
initialised from the seed and saved as safetensors, so HF transformers and SGLang load the same
model and their greedy outputs can be compared. The same seed and Python version give the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A small Llama: grouped KV heads (4 query heads share 2 KV heads), 4 layers, head_dim 32.
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                   max_position_embeddings=8192)
STAMP = "swiftcache_build.json"
CORPUS_FILES = 80  # stdlib modules, in sorted order, that the tokenizer is trained on


def corpus() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py"))[:CORPUS_FILES]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def build_tokenizer(out: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None, unk_token=None,
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, tokenizer, seed: int) -> None:
    import torch

    from sglang_swift.cpu_compat import torchvision_fix

    torchvision_fix.install()  # transformers imports torchvision; a no-op where it loads fine
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **MODEL_SHAPE, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), torch_dtype="float32",
        # A wider init than the 0.02 default gives peaked next-token distributions, so greedy
        # decoding is not decided by float rounding between two implementations.
        initializer_range=0.25,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                     do_sample=False).save_pretrained(out)


def fingerprint(out: Path) -> str:
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json"):
        h.update((out / name).read_bytes())
    return h.hexdigest()[:16]


def ensure_tiny_model(out: Path, seed: int = 0) -> Path:
    """Build the model into `out` unless a complete build for `seed` is already there.

    Builds in a private temporary directory and renames it into place, so concurrent callers
    (parallel test runs) never see a half-written model.
    """
    out = Path(out)
    if _build_seed(out) == seed:
        return out
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_tokenizer(tmp, MODEL_SHAPE["vocab_size"])
    build_model(tmp, tokenizer, seed)
    stamp = {"seed": seed, "shape": MODEL_SHAPE, "sha256_16": fingerprint(tmp)}
    (tmp / STAMP).write_text(json.dumps(stamp))
    if out.exists() and _build_seed(out) != seed:
        shutil.rmtree(out, ignore_errors=True)  # a stale or partial build
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    if _build_seed(out) != seed:
        raise RuntimeError(f"could not build the tiny model into {out}")
    return out


def _build_seed(out: Path) -> int | None:
    try:
        return json.loads((out / STAMP).read_text()).get("seed")
    except (FileNotFoundError, ValueError):
        return None


DEFAULT_DIR = Path(__file__).resolve().parent.parent / "artifacts" / "tiny-llama"
