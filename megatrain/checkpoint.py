"""Weights in and out, never holding a second full copy of the model in RAM.

Format of one save (a step folder of a checkpoint, see megatrain/checkpoint_layout.py): an HF
``save_pretrained`` folder (config.json, sharded safetensors + model.safetensors.index.json, and the
tokenizer / generation files of the folder the model came from), so HF and every baseline can load what
the engine saves; plus, for resume, ``optimizer-*.safetensors`` (AdamW m, v per group) and
``engine_state.json`` (step counts, engine config).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from . import arch
from . import checkpoint_layout as layout
from .checkpoint_layout import ENGINE_STATE
from .store import Group, ModelStore, make_groups, views

SHARD_BYTES = 2 * 2**30
WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_SINGLE = "model.safetensors"
OPTIM_INDEX = "optimizer.index.json"


# -- reading --------------------------------------------------------------------------------------
def read_config(path):
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} has no config.json")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    arch.check_supported(config)
    return config


def weight_map(path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from the index or the single file."""
    path = Path(path)
    if (path / WEIGHTS_INDEX).is_file():
        return dict(json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"])
    if (path / WEIGHTS_SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(path / WEIGHTS_SINGLE), framework="pt") as f:
            return {k: WEIGHTS_SINGLE for k in f.keys()}
    raise FileNotFoundError(f"checkpoint directory {str(path)!r} has neither {WEIGHTS_INDEX} nor {WEIGHTS_SINGLE}")


def validate_checkpoint_dir(path, groups: list[Group], meta_model=None) -> None:
    """Every file present and every tensor there with the right shape, checked from headers only."""
    from safetensors import safe_open

    wmap = weight_map(path)
    missing_files = sorted({f for f in wmap.values() if not (Path(path) / f).is_file()})
    if missing_files:
        raise FileNotFoundError(f"checkpoint {str(path)!r} is missing weight files: {', '.join(missing_files)}")
    needed = {name: s.shape for g in groups for name, s in zip(g.hf_names, g.spans)}
    missing = sorted(set(needed) - set(wmap))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise KeyError(f"checkpoint {str(path)!r} lacks tensors: {', '.join(missing[:5])}{more}")
    by_file: dict[str, list[str]] = {}
    for name in needed:
        by_file.setdefault(wmap[name], []).append(name)
    for fname, names in by_file.items():
        with safe_open(str(Path(path) / fname), framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise KeyError(f"{fname} does not contain {name} although the index says so")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(needed[name]):
                    raise ValueError(f"{name}: checkpoint shape {shape} != model shape {tuple(needed[name])}")


def load_into(store: ModelStore, path, groups: list[Group]) -> None:
    """Copy each tensor from its file into its fp32 master view, one tensor in RAM at a time."""
    from safetensors import safe_open

    wmap = weight_map(path)
    targets = {name: view for g in groups for name, view in zip(g.hf_names, views(store.master[g.name], g))}
    by_file: dict[str, list[str]] = {}
    for name in targets:
        by_file.setdefault(wmap[name], []).append(name)
    for fname, names in _progress(by_file.items(), len(by_file), f"load {Path(path).name}", "file", 2):
        with safe_open(str(Path(path) / fname), framework="pt") as f:
            for name in names:
                targets[name].copy_(f.get_tensor(name))


# -- random init ----------------------------------------------------------------------------------
def iter_init(meta_model, groups: list[Group], seed: int, device: torch.device):
    """Yield (group, tensors aligned with group.hf_names), materialising one group at a time on ``device``
    with HF's init scheme. Deterministic for a given seed and device type."""
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    model = meta_model.model
    for g in groups:
        if g.kind == "embed":
            modules = [model.embed_tokens]
        elif g.kind == "layer":
            modules = [model.layers[g.index]]
        else:
            modules = [model.norm] + ([] if meta_model.config.tie_word_embeddings else [meta_model.lm_head])
        for m in modules:
            m.to_empty(device=device)
            arch.init_module_(meta_model, m)
        params = {}
        for m, prefix in zip(modules, ["norm." if g.kind == "final" else "", "lm_head."]):
            for n, p in m.named_parameters():
                params[prefix + n] = p.detach()
        yield g, [params[s.name] for s in g.spans]
        for m in modules:
            m.to(device="meta")


def _progress(iterable, total: int, desc: str, unit: str = "group", min_total: int = 16):
    """A progress bar for long host work (big models); silent for small ones."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=total < min_total, leave=False)


def init_into(store: ModelStore, meta_model, groups: list[Group], seed: int, device: torch.device) -> None:
    for g, tensors in _progress(iter_init(meta_model, groups, seed, device), len(groups), "init weights"):
        for view, t in zip(views(store.master[g.name], g), tensors):
            view.copy_(t)


def write_initial_weights(spec_or_config, out_dir, seed: int = 0, device: str = "cpu") -> Path:
    """Materialise a random-init model as an HF folder, group by group (never the whole model in RAM).
    Every system of a benchmark point loads this same folder."""
    config = spec_or_config.to_hf_config() if hasattr(spec_or_config, "to_hf_config") else spec_or_config
    meta = arch.build_meta_model(config)
    groups = make_groups(meta)
    out = Path(out_dir)

    def tensors():
        for g, ts in _progress(iter_init(meta, groups, seed, torch.device(device)), len(groups), "init weights"):
            for name, t in zip(g.hf_names, ts):
                yield name, t.detach().to("cpu", torch.float32).contiguous()

    def write(tmp: Path):
        config.save_pretrained(str(tmp))
        _write_shards(tensors(), tmp, "model", WEIGHTS_INDEX)

    return layout.write_new_folder(out, write)


# -- saving ---------------------------------------------------------------------------------------
# Files of an HF model folder beside config.json and the weights: a save carries them over from the
# folder the model came from (from_pretrained), so every step folder is a complete model folder.
HF_EXTRAS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
             "generation_config.json")


def save(engine, path, keep: int = 2) -> Path:
    """One save into checkpoint folder ``path`` (see checkpoint_layout): a new step folder with weights,
    AdamW state and engine state, made ``latest``; the engine's saves beyond the newest ``keep`` removed.
    Returns the step folder."""
    store, groups = engine.store, engine.groups

    def optim():
        for g in groups:
            yield f"{g.name}.exp_avg", store.m[g.name].cpu()  # GPU tier: one group in host RAM at a time
            yield f"{g.name}.exp_avg_sq", store.v[g.name].cpu()

    def write(tmp: Path):
        _write_model(engine, tmp)
        _write_shards(optim(), tmp, "optimizer", OPTIM_INDEX)
        state = {"step": engine.step_count, "group_steps": {g.name: float(store.steps[g.name]) for g in groups},
                 "engine_config": asdict(engine.cfg)}
        (tmp / ENGINE_STATE).write_text(json.dumps(state, indent=2))

    return layout.save_step(path, engine.step_count, write, keep)


def export_hf(engine, path) -> Path:
    """The weights alone as a plain HF folder at ``path`` (new or empty; written whole or not at all)."""
    return layout.write_new_folder(path, lambda tmp: _write_model(engine, tmp))


def _write_model(engine, out: Path) -> None:
    store = engine.store

    def weights():
        for g in engine.groups:
            for name, view in zip(g.hf_names, views(store.master[g.name], g)):
                yield name, _host_copy(view)  # safetensors refuses views sharing one buffer

    engine.config.save_pretrained(str(out))
    _write_shards(weights(), out, "model", WEIGHTS_INDEX)
    source = getattr(engine, "source_dir", None)
    for name in HF_EXTRAS if source else ():
        if (Path(source) / name).is_file() and not (out / name).exists():
            shutil.copyfile(Path(source) / name, out / name)


def read_engine_state(path):
    from .config import EngineConfig

    f = Path(path) / ENGINE_STATE
    if not f.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no {ENGINE_STATE}: not a MegaTrain save (use from_pretrained "
                                f"to start from plain weights)")
    state = json.loads(f.read_text())
    cfg = state["engine_config"]
    cfg["optim"]["betas"] = tuple(cfg["optim"]["betas"])
    return EngineConfig(**cfg), int(state["step"])


def load_optimizer_into(store: ModelStore, path, groups: list[Group]) -> None:
    from safetensors import safe_open

    path = Path(path)
    index = path / OPTIM_INDEX
    if not index.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no {OPTIM_INDEX}")
    wmap = json.loads(index.read_text())["weight_map"]
    state = json.loads((path / ENGINE_STATE).read_text())
    for fname in sorted(set(wmap.values())):
        if not (path / fname).is_file():
            raise FileNotFoundError(f"{str(path)!r} is missing optimizer file {fname}")
    for fname in sorted(set(wmap.values())):
        with safe_open(str(path / fname), framework="pt") as f:
            for key in f.keys():
                group, _, what = key.rpartition(".")
                target = store.m if what == "exp_avg" else store.v
                target[group].copy_(f.get_tensor(key))
    for g in groups:
        store.steps[g.name].fill_(state["group_steps"][g.name])


# -- helpers --------------------------------------------------------------------------------------
def _write_shards(items, out: Path, prefix: str, index_name: str) -> None:
    """Write (name, tensor) pairs into ~SHARD_BYTES safetensors shards plus an HF-style index."""
    from safetensors.torch import save_file

    shards, current, size, total = [], {}, 0, 0
    for name, t in items:
        current[name] = t
        size += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
    if current or not shards:
        shards.append(current)
    wmap = {}
    for i, shard in enumerate(shards):
        fname = f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        wmap.update({name: fname for name in shard})
        shard.clear()
    (out / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.cpu() if t.device.type != "cpu" else t.clone()
