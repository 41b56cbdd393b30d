"""Tiny GGUF files written by the tests themselves (no download): a random HF model exported the way
llama.cpp's convert_hf_to_gguf.py does it (gguf-py's tensor names, q/k rows permuted for "llama", 1-D
tensors in F32, 2-D ones in the chosen type), with a tiny byte-level BPE tokenizer and a ChatML template.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MERGES = [("W", "h"), ("Ġ", "i")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(5, 256)]  # control bytes 0-4 left out: 256 tokens in all


def vocab() -> list[str]:
    """256 tokens (the tiny presets' vocabulary): 251 bytes, 2 merges, 3 special tokens."""
    return byte_tokens() + ["".join(m) for m in MERGES] + SPECIALS


def hf_config(family: str = "llama", tied: bool = True, layers: int = 2):
    """The tiny presets' shape (megatrain.spec tiny-llama: 4 layers, untied)."""
    from transformers import AutoConfig

    kw = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=len(vocab()), tie_word_embeddings=tied,
              max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, use_cache=False)
    cfg = AutoConfig.for_model(family, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def random_model(family: str = "llama", tied: bool = True, seed: int = 0, layers: int = 2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, tied, layers), attn_implementation="sdpa")
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: make every tensor informative
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.float().eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotary pairs (i, i + d/2) stored as (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, qtype: str = "F32") -> Path:
    """Export ``model`` (an HF Llama/Qwen2 causal LM) to ``path`` with 2-D weights in ``qtype``
    (F32, F16, Q8_0, Q4_0, Q4_1, ...)."""
    import gguf

    cfg = model.config
    arch = {"llama": "llama", "qwen2": "qwen2"}[cfg.model_type]
    arch_key = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_key, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                               else cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(0)
    toks = vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([3 if t in SPECIALS else 1 for t in toks])
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(toks.index("<|im_start|>"))
    w.add_eos_token_id(toks.index("<|im_end|>"))
    w.add_pad_token_id(toks.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    quant = gguf.GGMLQuantizationType[qtype]
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        arr = t.detach().float().numpy().copy()
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            arr = _permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            arr = _permute(arr, cfg.num_key_value_heads)
        name = f"{names.get_name(base)}.{suffix}"
        if arr.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr.astype(np.float32))
        elif quant == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, quant), raw_dtype=quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
