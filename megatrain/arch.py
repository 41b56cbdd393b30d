"""What the engine needs to know about an HF decoder-only model, and nothing more.

The HF model is built on the meta device (no memory), so the model definition stays plain HF code;
this module only answers: which parameters form a decoder layer, how the embedding, final norm and
LM head are named, how masks and rotary embeddings are made, and how to run one layer.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .chunked_mlp import resolve_chunk, tokenwise_checkpoint

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

EMBED_NAME = "model.embed_tokens.weight"
NORM_NAME = "model.norm.weight"
HEAD_NAME = "lm_head.weight"
LAYER_PREFIX = "model.layers.{}."


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r} (architectures={getattr(config, 'architectures', None)}); "
            f"MegaTrain supports HF decoder-only causal LMs of types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def build_meta_model(config):
    """The whole HF causal LM on the meta device: structure and names, zero bytes."""
    from transformers import AutoModelForCausalLM

    check_supported(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)


@dataclass
class ParamSpan:
    """Where one parameter lives inside a flat group buffer (its span; "slot" is only ever a GPU weight slot)."""

    name: str  # name relative to the group's module (e.g. "self_attn.q_proj.weight")
    shape: torch.Size
    offset: int
    numel: int


def flat_layout(named_shapes: list[tuple[str, torch.Size]], align: int = 64) -> tuple[list[ParamSpan], int]:
    """Offsets of parameters packed in one flat buffer; each start aligned to ``align`` elements so views
    stay 16-byte aligned for vectorised kernels. Returns (slots, total numel incl. padding)."""
    slots, offset = [], 0
    for name, shape in named_shapes:
        offset = (offset + align - 1) // align * align
        numel = int(torch.Size(shape).numel())
        slots.append(ParamSpan(name, torch.Size(shape), offset, numel))
        offset += numel
    return slots, (offset + align - 1) // align * align


def layer_kinds(config) -> list[str]:
    """Attention kind of each layer ("full_attention" / "sliding_attention"): layers of different kinds
    need different templates (the kind is fixed at module construction time in HF)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)[:n]
    if getattr(config, "model_type", "") == "mistral" and getattr(config, "sliding_window", None):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _call_with_supported(fn, **kwargs):
    """Call an HF helper passing only the keyword arguments its signature has (5.x renames kwargs)."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def make_masks(config, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor) -> dict[str, object]:
    """The 4D (or None, for SDPA's is_causal fast path) masks per attention kind, made the way the HF
    model's own forward makes them."""
    from transformers import masking_utils

    common = dict(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                  cache=None, past_key_values=None, position_ids=position_ids,
                  cache_position=torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device))
    masks = {"full_attention": _call_with_supported(masking_utils.create_causal_mask, **common)}
    if "sliding_attention" in layer_kinds(config):
        masks["sliding_attention"] = _call_with_supported(masking_utils.create_sliding_window_causal_mask, **common)
    return masks


def build_rotary(meta_model, device: torch.device) -> nn.Module:
    """A real (non-meta) copy of the model's rotary embedding module on ``device``."""
    meta_rotary = meta_model.model.rotary_emb
    with torch.device("cpu"):  # its inv_freq is computed at construction; not on meta
        rotary = type(meta_rotary)(config=meta_model.config)
    return rotary.to(device)


def run_layer(layer: nn.Module, hidden: torch.Tensor, mask, position_ids, position_embeddings,
              mlp_chunk_tokens: int = -1) -> torch.Tensor:
    """One decoder layer on ``hidden`` [batch, seq, h].

    ``mlp_chunk_tokens`` (-1 never, 0 auto, N tokens; the engine passes the placement plan's resolved value,
    megatrain/planner.py) bounds the layer's autograd working set at long sequences (see
    megatrain/chunked_mlp.py). When it resolves to "no chunking" the HF layer's own forward runs, exactly
    as without this option. Otherwise the layer's submodules are called explicitly in the order every
    supported family's decoder layer uses (transformers 5.x, llama / qwen2 / qwen3 / mistral):

        x + self_attn(input_layernorm(x))  ->  h + mlp(post_attention_layernorm(h))

    with the input norm and the whole "norm -> MLP -> residual" part recomputed token chunk by chunk in
    backward, so only their inputs are kept (no fp32 norm copies, no t x f MLP intermediates)."""
    chunk = resolve_chunk(mlp_chunk_tokens, hidden.shape[0] * hidden.shape[1])
    if chunk == 0:
        out = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out
    norm1, norm2, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
    normed = tokenwise_checkpoint(norm1, chunk, hidden, list(norm1.parameters()))
    attn, _ = layer.self_attn(hidden_states=normed, attention_mask=mask, position_ids=position_ids,
                              position_embeddings=position_embeddings)
    hidden = hidden + attn
    return tokenwise_checkpoint(lambda h: h + mlp(norm2(h)), chunk, hidden,
                                [*norm2.parameters(), *mlp.parameters()])


def init_module_(meta_model, module: nn.Module) -> None:
    """HF's own weight init applied to one materialised submodule (e.g. a decoder layer)."""
    with torch.no_grad():
        for sub in module.modules():
            meta_model._init_weights(sub)
