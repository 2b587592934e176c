"""Small models (Llama, and other kinds) with a locally trained tokenizer; no hub access needed.

CLI: `python scripts/build_tiny_model.py [--shape tiny|small|mla|swa|moe] [--out DIR] [--seed 0]`.

Two named shapes, so a node can run two different models (a donor and a bigger borrower):
- `tiny` (artifacts/tiny-llama): 4 layers, hidden 128, 2 KV heads of 32; about 0.9 M parameters.
  Its prefill does about 1.3 kFLOP per byte of KV it writes: recompute is nearly free, so it
  shows mechanisms, not timings.
- `small` (artifacts/small-llama): 8 layers, hidden 512, 8 query heads and 4 KV heads of 32;
  about 22.6 M parameters, 8 KiB of KV per token (fp32), about 5 kFLOP per KV byte; the model
  the CPU timings use. (Qwen3-32B does about 244 kFLOP per KV byte.)
Other model kinds at `tiny`'s size, for the support matrix (docs/models.md): `mla`
(artifacts/tiny-mla, DeepSeek-V2's MLA), `swa` (artifacts/tiny-swa, Mellum's hybrid sliding
window) and `moe` (artifacts/tiny-moe, Mixtral's routed experts).

The tokenizer is a byte-level BPE trained on Python's own standard-library sources (present on every
machine with Python), with ChatML-style special tokens and chat template. The weights are randomly
initialised from the seed, then scaled (`sensitize`), and saved as safetensors, so HF transformers
and SGLang load the same model and their greedy outputs can be compared. The same seed and Python
version give the same files.

Why the scaling: "outputs identical token for token" is the tests' evidence that no KV row was
copied wrong, which holds only if one wrong row changes the tokens. Freshly initialised, these
models fail that: the first layer's output is hundreds of times the embedding it adds to, so it
dominates the residual stream of every later layer, whose attention then moves the logits little;
and the query-key scores are so spread (init 0.25) that each query puts about 95% of its weight on
one token, so a wrong row elsewhere is rarely read. `sensitize` scales layer l's attention output
projection by `ATTN_OUT_GROWTH ** l` (later layers write more into the residual stream) and the
query and key projections by `QK_SCALE` (a query spreads its weight over a few tokens).
Measured with HF transformers (fp32) on the `small` model: one KV row (one layer, one token of a
random 40-token prompt) replaced by random values at its own scale, and 32 greedy tokens
compared with the clean run's, for 10 prompts and each layer: before scaling the tokens changed
in 10/10 cases for layer 0 and 4-7/10 for layers 1-7; after it, 10/10 for layers 0-5 and 9/10
for layers 6 and 7 (the `tiny` model: 10/10 for each of its 4 layers).
The price is sensitivity to float rounding too, which is what a near-tie (harness.TIE_NATS,
2e-3 nats) absorbs: the largest logprob difference between a 120-token prompt computed at once
and the same prompt computed on a cached 70-token prefix went from 1-3e-5 nats to 0.5-1.2e-4
(`small`; `tiny` 0.6-0.8e-5). Stronger scalings caught every row but turned chaotic: growth 2
or 3 with q/k 0.7 left float rounding moving logprobs by 2e-3 to 2e-2 nats, and stock HiCache's
outputs then differed from stock SGLang's in real tokens, not near-ties.
`tests/integration/test_negative_control.py` checks the sensitivity in a live borrower.
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
VOCAB_SIZE = 2048
MODEL_SHAPES = {
    # grouped KV heads (4 query heads share 2 KV heads), 4 layers, head_dim 32
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE,
                 max_position_embeddings=8192),
    # 8 layers, 8 query heads sharing 4 KV heads of 32 (head_dim set explicitly: not hidden/heads)
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  vocab_size=VOCAB_SIZE, max_position_embeddings=8192),
}
# MLA (DeepSeek-V2's attention, `DeepseekV2ForCausalLM`): one 576-wide latent row per token and
# layer (kv_lora_rank 512 + rope 64, DeepSeek-V2's own widths), 4 layers, hidden 128, dense MLPs
# (first_k_dense_replace = layers; the MoE fields are required by the config but unused).
MLA_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                 qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 vocab_size=VOCAB_SIZE, max_position_embeddings=8192, first_k_dense_replace=4,
                 moe_layer_freq=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                 moe_intermediate_size=64)
MODEL_SHAPES["mla"] = MLA_SHAPE
# Hybrid sliding-window attention (`MellumForCausalLM`, SGLang's `SWAKVPool`): full and 64-token
# window layers alternating, 4 layers, hidden 128, 2 KV heads of 32, dense MLPs (the MoE fields
# are required by the config but unused); query and key RMS-normalised per head, as Qwen3's.
SWA_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 layer_types=["full_attention", "sliding_attention"] * 2,
                 mlp_layer_types=["dense"] * 4, sliding_window=64, num_local_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=64,
                 vocab_size=VOCAB_SIZE, max_position_embeddings=8192)
MODEL_SHAPES["swa"] = SWA_SHAPE
# Mixture of experts (`MixtralForCausalLM`): `tiny`'s attention (4 layers, 2 KV heads of 32, so
# the same KV pool) with 4 experts per layer, 2 routed per token.
MOE_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                 num_experts_per_tok=2, vocab_size=VOCAB_SIZE, max_position_embeddings=8192)
MODEL_SHAPES["moe"] = MOE_SHAPE
# SGLang's CPU RoPE for DeepSeek models takes DeepSeek's YaRN only; factor 1 leaves the plain RoPE
MLA_ROPE = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 1.0,
            "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}
# SGLang's CPU engine serves this model with `--attention-backend triton` under TRITON_INTERPRET=1
# (its torch_native backend reads the latent rows where DeepSeek's prefill without a cached prefix
# passes K and V of the heads' width, and `intel_amx` needs AMX). One KV split for its decode
# kernel (SGLang's default: 8): the interpreter runs every program of the grid in turn, so eight
# splits of a short context cost about 1.7x the decode time of one (4 requests of 12 tokens: 49 s
# against 29 s here); stock and SwiftCache servers of this model take the same arguments.
MLA_SERVER_ARGS = ("--attention-backend", "triton", "--triton-attention-num-kv-splits", "1")
MODEL_SHAPE = MODEL_SHAPES["tiny"]
STAMP = "swiftcache_build.json"
# The weights' recipe; a build stamped with another (or none) is rebuilt.
BUILD_RECIPE = 3
ATTN_OUT_GROWTH = 1.5  # layer l's o_proj is scaled by ATTN_OUT_GROWTH ** l
QK_SCALE = 0.5  # q_proj and k_proj are scaled by this (attention logits by its square)
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


def build_model(out: Path, tokenizer, seed: int, shape: str = "tiny") -> None:
    import torch

    from sglang_swift.cpu_compat import torchvision_fix

    torchvision_fix.install()  # transformers imports torchvision; a no-op where it loads fine
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    other = {"mla": _build_mla, "swa": _build_swa, "moe": _build_moe}.get(shape)
    if other is not None:
        other(out, tokenizer)
        return
    config = LlamaConfig(**MODEL_SHAPES[shape], rope_theta=10000.0, **_common(tokenizer))
    model = LlamaForCausalLM(config).eval()
    sensitize(model)
    _save(model, config, out)


def _build_mla(out: Path, tokenizer) -> None:
    """The `mla` shape: DeepSeek-V2's attention at a tiny size, weights scaled as `sensitize`
    scales a Llama's (layer l's attention output by ATTN_OUT_GROWTH ** l, the attention logits
    by QK_SCALE squared, through the query projection)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(**MLA_SHAPE, rope_parameters=dict(MLA_ROPE), **_common(tokenizer))
    model = DeepseekV2ForCausalLM(config).eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.mul_(ATTN_OUT_GROWTH ** i)
            layer.self_attn.q_proj.weight.mul_(QK_SCALE ** 2)
    _save(model, config, out)
    saved = json.loads((out / "config.json").read_text())
    saved.update(moe_layer_freq=MLA_SHAPE["moe_layer_freq"], rope_parameters=dict(MLA_ROPE))
    (out / "config.json").write_text(json.dumps(saved, indent=2))  # fields SGLang reads


def _save(model, config, out: Path) -> None:
    """The weights as safetensors and a greedy generation config beside them."""
    from transformers import GenerationConfig

    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                     do_sample=False).save_pretrained(out)


def _common(tokenizer) -> dict:
    """The config fields every shape shares: float32 weights, the chat tokens, and an init wider
    than the 0.02 default, which gives peaked next-token distributions, so greedy decoding is
    not decided by float rounding between two implementations."""
    return dict(rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                torch_dtype="float32", initializer_range=0.25)


def _build_swa(out: Path, tokenizer) -> None:
    """The `swa` shape: hybrid sliding-window attention at a tiny size, weights scaled as
    `sensitize` scales a Llama's (layer l's attention output by ATTN_OUT_GROWTH ** l; the
    attention logits by QK_SCALE squared, through the per-head query and key norms, which
    would undo a scaled projection)."""
    import torch
    from transformers import MellumConfig, MellumForCausalLM

    config = MellumConfig(**SWA_SHAPE, **_common(tokenizer))
    model = MellumForCausalLM(config).eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.mul_(ATTN_OUT_GROWTH ** i)
            layer.self_attn.q_norm.weight.mul_(QK_SCALE)
            layer.self_attn.k_norm.weight.mul_(QK_SCALE)
    _save(model, config, out)


def _build_moe(out: Path, tokenizer) -> None:
    """The `moe` shape: a Llama's attention, scaled by `sensitize`, with routed experts."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**MOE_SHAPE, rope_theta=10000.0, **_common(tokenizer))
    model = MixtralForCausalLM(config).eval()
    sensitize(model)
    _save(model, config, out)


def sensitize(model) -> None:
    """Scale a freshly initialised Llama so that one wrong KV row in any layer changes its
    greedy tokens (see the module docstring): layer l's attention output projection by
    `ATTN_OUT_GROWTH ** l`, every query and key projection by `QK_SCALE`."""
    import torch

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.mul_(ATTN_OUT_GROWTH ** i)
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)


def fingerprint(out: Path) -> str:
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json"):
        h.update((out / name).read_bytes())
    return h.hexdigest()[:16]


def ensure_tiny_model(out: Path | None = None, seed: int = 0, shape: str = "tiny") -> Path:
    """Build model `shape` into `out` (default: its directory under artifacts/) unless a complete
    build for `seed` and `shape` is already there.

    Builds in a private temporary directory and renames it into place, so concurrent callers
    (parallel test runs) never see a half-written model.
    """
    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {sorted(MODEL_SHAPES)}")
    out = Path(out) if out is not None else model_dir(shape)
    if _build_id(out) == (seed, shape):
        return out
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_tokenizer(tmp, VOCAB_SIZE)
    build_model(tmp, tokenizer, seed, shape)
    stamp = {"seed": seed, "shape_name": shape, "shape": MODEL_SHAPES[shape],
             "recipe": BUILD_RECIPE, "sha256_16": fingerprint(tmp)}
    (tmp / STAMP).write_text(json.dumps(stamp))
    if out.exists() and _build_id(out) != (seed, shape):
        shutil.rmtree(out, ignore_errors=True)  # a stale or partial build
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    if _build_id(out) != (seed, shape):
        raise RuntimeError(f"could not build the {shape} model into {out}")
    return out


def _build_id(out: Path) -> tuple[int, str] | None:
    """(seed, shape name) of the complete build in `out` made with this `BUILD_RECIPE`, or
    None (none there, incomplete, or an older recipe's weights)."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (FileNotFoundError, ValueError):
        return None
    if stamp.get("recipe") != BUILD_RECIPE:
        return None
    return stamp.get("seed"), stamp.get("shape_name", "tiny")


ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"  # the repository's artifacts/


def model_dir(shape: str) -> Path:
    return ARTIFACTS / (f"tiny-{shape}" if shape in ("mla", "swa", "moe") else f"{shape}-llama")


DEFAULT_DIR = model_dir("tiny")
