"""Model specs: one small dataclass that every system (engine and baselines) builds from.

A spec names a supported HF decoder family and its shape. ``to_hf_config`` turns it into the HF
config object that the engine and every baseline instantiate, so "the same model" means the same
config, not merely similar numbers.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, replace

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only causal LM of one of the supported HF families."""

    family: str = "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 256
    tie_embeddings: bool = True
    max_position_embeddings: int = 32768
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"unsupported model family {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelSpec.{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def scaled(self, depth: int | None = None, width: float | None = None) -> "ModelSpec":
        """Depth sets the layer count; width multiplies hidden and FFN size (heads scale with hidden,
        head_dim fixed), the knobs of the paper's depth and width sweeps."""
        spec = self
        if depth is not None:
            spec = replace(spec, num_layers=int(depth))
        if width is not None and width != 1.0:
            hd = spec.resolved_head_dim
            heads = max(spec.num_kv_heads, int(round(spec.num_heads * width / spec.num_kv_heads)) * spec.num_kv_heads)
            spec = replace(
                spec,
                num_heads=heads,
                hidden_size=heads * hd,
                head_dim=hd,
                intermediate_size=int(round(spec.intermediate_size * width / 64)) * 64,
            )
        return spec

    def num_params(self) -> int:
        """Exact parameter count of the HF model this spec builds (embeddings counted once if tied)."""
        h, hd = self.hidden_size, self.resolved_head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = h * q + 2 * h * kv + q * h
        if self.family == "qwen2":  # q/k/v biases
            attn += q + 2 * kv
        if self.family == "qwen3":  # q_norm, k_norm
            attn += 2 * hd
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h
        return self.num_layers * layer + embed + h + (0 if self.tie_embeddings else embed)

    def to_hf_config(self, attn_implementation: str = "sdpa"):
        """The HF config object for this spec (dropout off, no KV cache)."""
        from transformers import AutoConfig

        kwargs = dict(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            use_cache=False,
            attention_dropout=0.0,
        )
        if self.head_dim is not None or self.family == "qwen3":
            kwargs["head_dim"] = self.resolved_head_dim
        if self.family == "mistral":
            kwargs["sliding_window"] = None
        cfg = AutoConfig.for_model(self.family, **kwargs)
        cfg._attn_implementation = attn_implementation
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)


# Shapes used by the paper's experiments and by our tests. Sizes are the public HF configs' shapes.
PRESETS: dict[str, ModelSpec] = {
    "tiny-llama": ModelSpec("llama", 64, 4, 4, 2, 128, 256, tie_embeddings=False, max_position_embeddings=512, name="tiny-llama"),
    "tiny-qwen2": ModelSpec("qwen2", 64, 4, 4, 2, 128, 256, tie_embeddings=True, max_position_embeddings=512, name="tiny-qwen2"),
    "tiny-qwen3": ModelSpec("qwen3", 64, 4, 4, 2, 128, 256, tie_embeddings=False, head_dim=32, max_position_embeddings=512, name="tiny-qwen3"),
    "tiny-mistral": ModelSpec("mistral", 64, 4, 4, 2, 128, 256, tie_embeddings=False, max_position_embeddings=512, name="tiny-mistral"),
    "qwen2.5-0.5b": ModelSpec("qwen2", 896, 24, 14, 2, 4864, 151936, True, name="qwen2.5-0.5b"),
    "qwen2.5-1.5b": ModelSpec("qwen2", 1536, 28, 12, 2, 8960, 151936, True, name="qwen2.5-1.5b"),
    "qwen2.5-3b": ModelSpec("qwen2", 2048, 36, 16, 2, 11008, 151936, True, name="qwen2.5-3b"),
    "qwen2.5-7b": ModelSpec("qwen2", 3584, 28, 28, 4, 18944, 152064, False, name="qwen2.5-7b"),
    "qwen2.5-14b": ModelSpec("qwen2", 5120, 48, 40, 8, 13824, 152064, False, name="qwen2.5-14b"),
    "qwen2.5-32b": ModelSpec("qwen2", 5120, 64, 40, 8, 27648, 152064, False, name="qwen2.5-32b"),
    "qwen2.5-72b": ModelSpec("qwen2", 8192, 80, 64, 8, 29568, 152064, False, name="qwen2.5-72b"),
    # Dense stand-in with GPT-OSS-120B's parameter count (~117B): the real model is MoE, which the
    # engine does not stream yet; this keeps the host-memory footprint of the paper's largest run.
    "gpt-oss-120b-dense": ModelSpec("qwen2", 8192, 116, 64, 8, 33792, 201088, False, name="gpt-oss-120b-dense"),
    # SmolLM2-135M-Instruct (the SFT accuracy sweep's pretrained model, shipped as a GGUF: docs/sft.md)
    "smollm2-135m": ModelSpec("llama", 576, 30, 9, 3, 1536, 49152, True, max_position_embeddings=8192,
                              rope_theta=100000.0, rms_norm_eps=1e-5, name="smollm2-135m"),
    "llama3-8b": ModelSpec("llama", 4096, 32, 32, 8, 14336, 128256, False, rope_theta=500000.0, name="llama3-8b"),
}


# RoPE types whose scaling is anchored to the pretraining length (HF reads it from
# rope_parameters["original_max_position_embeddings"], falling back to max_position_embeddings).
_ANCHORED_ROPE = ("llama3", "yarn", "longrope")


def with_positions(model, n: int):
    """``model`` (a ModelSpec or an HF config) asking for ``n`` positions: the one supported way to train
    sequences longer than the model's own ``max_position_embeddings`` (n = 0: unchanged).

    RoPE stays as the family defines it: the rotary frequencies of the default RoPE do not depend on the
    maximum, and any rope scaling (``rope_parameters`` / ``rope_scaling``) is passed through unchanged. For
    scaling types anchored to the pretraining length (llama3, yarn, longrope) the original length is
    recorded in the rope parameters first (HF does the same when it builds such a config), so the anchor
    stays the model's pretraining length, not ``n``. An HF config is copied, never modified in place."""
    if n < 0:
        raise ValueError(f"max_position_embeddings override must be >= 0 (0 = the model's own), got {n}")
    if n == 0:
        return model
    if isinstance(model, ModelSpec):
        return replace(model, max_position_embeddings=int(n))
    cfg = copy.deepcopy(model)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in _ANCHORED_ROPE:
        rope.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    cfg.max_position_embeddings = int(n)
    return cfg


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
