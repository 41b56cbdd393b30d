"""GGUF import: a llama.cpp GGUF file of a supported family (Llama, Mistral, Qwen2, Qwen3) as the HF folder
that the engine and every baseline load: weights de-quantized to fp32, tokenizer and chat template kept.

    python -m megatrain.gguf_import model.gguf out_dir/      # one-step converter (prints what it wrote)
    MegaTrain.from_pretrained("model.gguf", cfg)             # converted into a temporary folder, then loaded

Config and tokenizer come from transformers' own GGUF readers (``AutoConfig`` / ``AutoTokenizer`` with
``gguf_file=``), so they are what ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` builds. The
weights are de-quantized here, one tensor at a time (``gguf.dequantize``, exact for every type gguf-py
reads: F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, K-quants, ...), named with gguf-py's own tensor-name map, and
for the ``llama`` architecture (Llama and Mistral GGUFs) llama.cpp's rotary permutation of q/k is undone,
as transformers does. Nothing holds two copies of the model: each tensor is written into ~2 GiB
safetensors shards as it is produced.

Needs the ``gguf`` package (``pip install gguf``; pure Python).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from . import arch
from .checkpoint import WEIGHTS_INDEX, _write_shards
from .checkpoint_layout import CheckpointRefused, write_new_folder
from .store import make_groups

# GGUF architectures whose q/k rows llama.cpp permutes on export (convert_hf_to_gguf.py: LlamaModel.permute).
PERMUTED_QK = ("llama",)


def _require_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError("reading a GGUF file needs the 'gguf' package: pip install gguf") from None
    return gguf


def _check_file(path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file (no GGUF magic in its first 4 bytes)")
    return path


def read_config(path):
    """The HF config transformers reads from the GGUF's metadata (fp32), refused unless the engine
    supports its family."""
    from transformers import AutoConfig

    path = _check_file(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    arch.check_supported(config)
    config.dtype = torch.float32  # de-quantized masters are fp32 (config.json says so)
    return config


def read_tokenizer(path):
    """The tokenizer (vocabulary, merges, special tokens, chat template) stored in the GGUF."""
    from transformers import AutoTokenizer

    path = _check_file(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _reverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (its rotary pairs (i, i + d/2) stored as (2i, 2i + 1))."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def iter_tensors(path, config) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every parameter the engine trains, in the engine's group order, each
    de-quantized when it is reached. Raises for a missing tensor or a shape that does not match the
    config; GGUF tensors the HF model has no parameter for (e.g. precomputed ``rope_freqs``) are skipped."""
    gguf = _require_gguf()
    path = _check_file(path)
    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{str(path)!r} has no general.architecture")
    gguf_arch = bytes(field.parts[field.data[0]]).decode()
    arch_key = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch), None)
    if arch_key is None:
        raise ValueError(f"GGUF architecture {gguf_arch!r} is unknown to gguf {getattr(gguf, '__version__', '')}")
    name_map = gguf.get_tensor_name_map(arch_key, config.num_hidden_layers)
    by_name = {t.name: t for t in reader.tensors}
    groups = make_groups(arch.build_meta_model(config))
    permute = gguf_arch in PERMUTED_QK
    for g in groups:
        for hf_name, span in zip(g.hf_names, g.spans):
            base, _, suffix = hf_name.rpartition(".")
            gguf_name = name_map.get_name(base)
            tensor = by_name.get(f"{gguf_name}.{suffix}") if gguf_name else None
            if tensor is None:
                raise KeyError(f"{str(path)!r} has no tensor for {hf_name} (GGUF name "
                               f"{gguf_name + '.' + suffix if gguf_name else 'unknown'})")
            w = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).astype("float32"))  # a copy: the reader maps the file read-only
            if tuple(w.shape) != tuple(span.shape):
                raise ValueError(f"{hf_name}: GGUF tensor {tensor.name} has shape {tuple(w.shape)}, the config "
                                 f"says {tuple(span.shape)}")
            if permute and suffix == "weight" and base.endswith(("self_attn.q_proj", "self_attn.k_proj")):
                heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
                w = _reverse_permute(w, heads)
            yield hf_name, w.contiguous()


def convert(path, out_dir) -> Path:
    """Write ``out_dir``: config.json, generation_config.json, fp32 safetensors shards + index, and the
    tokenizer files (with the chat template). ``out_dir`` must be new or empty (anything else is refused, nothing
    is replaced); written to a hidden sibling and renamed into place (a crash never leaves half of one).
    Returns ``out_dir``."""
    from transformers import GenerationConfig

    _require_gguf()
    config = read_config(path)
    tokenizer = read_tokenizer(path)
    out = Path(out_dir)

    def write(tmp: Path) -> None:
        config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _write_shards(iter_tensors(path, config), tmp, "model", WEIGHTS_INDEX)

    write_new_folder(out, write)
    return out


@contextlib.contextmanager
def converted(path) -> Iterator[Path]:
    """A temporary HF folder of the GGUF ``path``, removed on exit (``MegaTrain.from_pretrained``)."""
    with tempfile.TemporaryDirectory(prefix="megatrain-gguf-") as tmp:
        yield convert(path, Path(tmp) / "model")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="a .gguf file (Llama, Mistral, Qwen2 or Qwen3; any quantization gguf-py reads)")
    ap.add_argument("out_dir", help="the HF folder to write (must be new or empty: nothing is replaced)")
    args = ap.parse_args(argv)
    try:
        out = convert(args.gguf, args.out_dir)
    except (FileNotFoundError, ValueError, KeyError, ImportError, CheckpointRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import json

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(out))
    n = json.loads((out / WEIGHTS_INDEX).read_text())["metadata"]["total_size"] // 4
    print(f"wrote {out}: {config.model_type}, {config.num_hidden_layers} layers, {n / 1e6:.1f}M fp32 params, "
          f"tokenizer and chat template")
    return 0


if __name__ == "__main__":
    sys.exit(main())
