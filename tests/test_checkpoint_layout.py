"""The checkpoint folder (megatrain/checkpoint_layout.py): a real folder of step folders and a ``latest``
pointer; a save never moves or deletes what the engine did not write; copies (``cp -r``, ``tar``) load
and resume exactly; non-checkpoint folders are refused with one line and left as they were."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, OptimConfig, PRESETS
from megatrain import checkpoint_layout as layout
from megatrain.checkpoint_layout import CheckpointRefused
from megatrain.data import synthetic_batch

pytestmark = pytest.mark.timeout(300)
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1, total_steps=8)
SPEC = PRESETS["tiny-llama"]


def cfg(**kw):
    return EngineConfig(**{"device": "cpu", "micro_batches": 1, "checkpoint_interval": 2, "optim": OPTIM, **kw})


def batch(i):
    return synthetic_batch(SPEC.vocab_size, 2, 16, 3, i)


def new_engine(**kw):
    return MegaTrain.from_config(SPEC.to_hf_config("eager"), cfg(**kw), verbose=False)


def tree(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` with its bytes (files), its target (links) or "dir"."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = os.readlink(p) if p.is_symlink() else (p.read_bytes() if p.is_file() else "dir")
    return out


def ours(root: Path) -> list[str]:
    return [p.name for p in layout.steps(root)]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


# -- the layout -----------------------------------------------------------------------------------
def test_a_checkpoint_is_a_real_folder_of_step_folders_and_a_latest_pointer(tmp_path):
    e = new_engine()
    for i in range(3):
        e.step(batch(i))
        written = e.save(tmp_path / "ck")
        assert written == tmp_path / "ck" / f"step-{i + 1:06d}"
    ck = tmp_path / "ck"
    assert ck.is_dir() and not ck.is_symlink()
    assert sorted(p.name for p in ck.iterdir()) == ["latest", layout.ROOT_MARKER, "step-000002", "step-000003"]
    assert (ck / "latest").read_text() == "step-000003\n"
    assert not any(p.is_symlink() for p in ck.rglob("*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # nothing beside it
    # MegaTrain reads the root through latest, or any step folder named directly
    assert MegaTrain.load(ck, verbose=False).step_count == 3
    older = MegaTrain.load(ck / "step-000002", verbose=False)
    assert older.step_count == 2
    older.close()
    fp = MegaTrain.from_pretrained(ck, cfg(), verbose=False)
    for name, value in e.state_dict().items():
        torch.testing.assert_close(fp.state_dict()[name], value, rtol=0, atol=0)
    fp.close(), e.close()


@pytest.mark.parametrize("keep", [1, 3])
def test_keep_checkpoints_keeps_the_newest_saves(tmp_path, keep):
    e = new_engine(keep_checkpoints=keep)
    for i in range(4):
        e.step(batch(i))
        e.save(tmp_path / "ck")
    assert ours(tmp_path / "ck") == [f"step-{s:06d}" for s in range(5 - keep, 5)]
    e.close()
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 1"):
        cfg(keep_checkpoints=0)


def test_a_second_save_at_the_same_step_gets_its_own_folder(tmp_path):
    e = new_engine()
    e.save(tmp_path / "ck")
    e.save(tmp_path / "ck")
    assert ours(tmp_path / "ck") == ["step-000000", "step-000000.1"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000000.1"
    e.close()


# -- nothing the engine did not write is moved or deleted --------------------------------------------
def test_files_beside_and_inside_a_checkpoint_survive_saves(tmp_path):
    e = new_engine(keep_checkpoints=2)
    e.save(tmp_path / "ck")
    ck = tmp_path / "ck"
    # beside: a user's file, a folder named like the previous layout's hidden versions, one like a leftover
    (tmp_path / "notes.txt").write_text("beside")
    (tmp_path / ".ck.v123-4").mkdir()
    (tmp_path / ".ck.v123-4" / "mine.txt").write_text("not a save")
    (tmp_path / ".ck.link-99").write_text("mine too")
    # inside: notes, a hand-made step folder, a copy of an engine step under another name, a folder named
    # like a killed save's leftover but holding the user's files, one like it with a live writer
    (ck / "notes.txt").write_text("inside")
    (ck / "step-000999").mkdir()
    (ck / "step-000999" / "weights.bin").write_bytes(b"\0" * 8)
    shutil.copytree(ck / "step-000000", ck / "step-000000-keep")
    lookalike = ck / f"step-000007.tmp-{dead_pid()}-1"
    lookalike.mkdir()
    (lookalike / "data.txt").write_text("user data, no engine marker")
    live = ck / f"step-000008.tmp-{os.getppid()}-1"
    live.mkdir()
    (live / layout.STEP_MARKER).write_text("{}")
    before = {k: v for k, v in tree(tmp_path).items() if not k.startswith("ck/step-000000/")
              and k != "ck/step-000000" and k != "ck/latest"}
    for i in range(4):
        e.step(batch(i))
        e.save(ck)
    after = tree(tmp_path)
    assert {k: after.get(k) for k in before} == before
    assert ours(ck) == ["step-000003", "step-000004"]  # the engine's own older saves went, nothing else
    e.close()


def test_save_into_a_non_checkpoint_folder_is_refused_with_one_line(tmp_path):
    e = new_engine()
    target = tmp_path / "existing"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    before = tree(tmp_path)
    with pytest.raises(CheckpointRefused, match="not empty and not a MegaTrain checkpoint") as err:
        e.save(target)
    assert "\n" not in str(err.value) and "notes.txt" in str(err.value)
    e.save(tmp_path / "ck")
    before = tree(tmp_path)
    with pytest.raises(CheckpointRefused, match="one save of a checkpoint: save to the checkpoint folder"):
        e.save(tmp_path / "ck" / "step-000000")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointRefused, match="not a folder"):
        e.save(tmp_path / "a-file")
    (tmp_path / "a-file").unlink()
    assert tree(tmp_path) == before
    e.close()


def test_save_dot_refuses_a_busy_folder_and_adopts_an_empty_one(tmp_path, monkeypatch):
    e = new_engine()
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('my script')")
    (work / "data").mkdir()
    before = tree(tmp_path)
    monkeypatch.chdir(work)
    with pytest.raises(CheckpointRefused, match="train.py"):
        e.save(".")
    assert tree(tmp_path) == before
    (tmp_path / "beside.txt").write_text("beside")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    e.step(batch(0))
    e.save(".")
    assert (tmp_path / "beside.txt").read_text() == "beside"
    assert {k: v for k, v in tree(tmp_path).items() if k.startswith("work")} == before
    assert MegaTrain.load(".", verbose=False).step_count == 1
    e.close()


def test_an_hf_folder_keeps_its_tokenizer_and_every_save_carries_it(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(SPEC.to_hf_config("eager"))
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    tokenizer_files = {"tokenizer.json": '{"model": "tiny"}', "tokenizer_config.json": '{"model_max_length": 512}',
                       "special_tokens_map.json": "{}"}
    for name, text in tokenizer_files.items():
        (hf / name).write_text(text)
    before = tree(hf)
    e = MegaTrain.from_pretrained(hf, cfg(), verbose=False)
    with pytest.raises(CheckpointRefused, match="a model folder"):  # refused: never mixed with its files
        e.save(hf)
    assert tree(hf) == before
    e.step(batch(0))
    step = e.save(tmp_path / "ck")
    e.close()
    for name, text in tokenizer_files.items():
        assert (step / name).read_text() == text
    resumed = MegaTrain.load(tmp_path / "ck", verbose=False)  # its source is now the step folder
    resumed.step(batch(1))
    step2 = resumed.save(tmp_path / "ck")
    resumed.close()
    assert all((step2 / name).read_text() == text for name, text in tokenizer_files.items())


# -- copies resume exactly ------------------------------------------------------------------------
def test_cp_r_and_tar_copies_load_and_resume_exactly(tmp_path):
    e = new_engine()
    for i in range(2):
        e.step(batch(i))
        e.save(tmp_path / "ck")
    # cp -r ck backup/ and tar czf ck.tgz ck (the tools themselves where present), then the original is
    # gone: nothing in a copy may point back at it
    (tmp_path / "backup").mkdir()
    (tmp_path / "restored").mkdir()
    if shutil.which("cp") and shutil.which("tar"):
        for cmd in (["cp", "-r", "ck", "backup/"], ["tar", "czf", "ck.tgz", "ck"]):
            subprocess.run(cmd, cwd=tmp_path, check=True, timeout=120)
    else:
        shutil.copytree(tmp_path / "ck", tmp_path / "backup" / "ck", symlinks=True)
        with tarfile.open(tmp_path / "ck.tgz", "w:gz") as tar:
            tar.add(tmp_path / "ck", arcname="ck")
    shutil.rmtree(tmp_path / "ck")
    with tarfile.open(tmp_path / "ck.tgz") as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path / "restored", **safe)
    expected = [e.step(batch(i)).loss for i in range(2, 4)]
    weights = {k: v.clone() for k, v in e.state_dict().items()}
    e.close()
    for copy in (tmp_path / "backup" / "ck", tmp_path / "restored" / "ck"):
        assert not any(p.is_symlink() for p in copy.rglob("*"))
        r = MegaTrain.load(copy, verbose=False)
        assert r.step_count == 2
        assert [r.step(batch(i)).loss for i in range(2, 4)] == expected
        for name, value in r.state_dict().items():
            torch.testing.assert_close(value, weights[name], rtol=0, atol=0)
        r.save(copy)  # and it keeps working as a checkpoint
        assert ours(copy) == ["step-000002", "step-000004"]
        r.close()


# -- failures and leftovers -------------------------------------------------------------------------
def test_a_failed_first_save_leaves_no_trace(tmp_path, monkeypatch):
    from megatrain import checkpoint

    e = new_engine()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_write_shards", boom)
    with pytest.raises(OSError, match="disk full"):
        e.save(tmp_path / "new" / "ck")
    assert not (tmp_path / "new" / "ck").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="disk full"):
        e.save(tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []
    e.close()


def test_leftovers_of_killed_saves_are_swept_by_the_next_save(tmp_path):
    e = new_engine()
    e.save(tmp_path / "ck")
    ck, pid = tmp_path / "ck", dead_pid()
    half = ck / f"step-000005.tmp-{pid}-1"
    half.mkdir()
    (half / layout.STEP_MARKER).write_text(json.dumps({"format": layout.STEP_FORMAT, "name": "step-000005"}))
    (half / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 16)
    (ck / f"step-000003.tmp-{pid}-2").mkdir()  # killed between mkdir and the marker
    (ck / f"step-000002.del-{pid}-3").mkdir()
    (ck / f"latest.tmp-{pid}-4").write_text("step-000005\n")
    e.step(batch(0))
    e.save(ck)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", layout.ROOT_MARKER, "step-000000", "step-000001"]
    e.close()


def test_latest_pointer_errors_are_one_line(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / layout.ROOT_MARKER).write_text("{}")
    with pytest.raises(FileNotFoundError, match="holds no completed save yet"):
        MegaTrain.load(ck, verbose=False)
    (ck / "latest").write_text("step-000042\n")
    with pytest.raises(FileNotFoundError, match="names 'step-000042', which is missing"):
        MegaTrain.from_pretrained(ck, cfg(), verbose=False)
    (ck / "latest").write_text("../elsewhere\n")
    with pytest.raises(ValueError, match="must name a step folder inside it"):
        MegaTrain.load(ck, verbose=False)


# -- earlier layouts --------------------------------------------------------------------------------
def _previous_layout_save(e, tmp_path: Path) -> Path:
    """A save as the previous layout wrote it: ``ck`` a relative symlink to a hidden sibling version."""
    e.save(tmp_path / "scratch")
    version = tmp_path / ".ck.v1796000000000000000-4242"
    shutil.move(tmp_path / "scratch" / "step-000001", version)
    (version / layout.STEP_MARKER).unlink()
    shutil.rmtree(tmp_path / "scratch")
    os.symlink(version.name, tmp_path / "ck")
    return tmp_path / "ck"


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "unlink-rename"])
def test_a_save_of_the_previous_layout_loads_and_is_converted_in_place(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    e = new_engine()
    e.step(batch(0))
    ck = _previous_layout_save(e, tmp_path)
    (tmp_path / "notes.txt").write_text("beside")
    old = MegaTrain.load(ck, verbose=False)
    assert old.step_count == 1
    for name, value in e.state_dict().items():
        torch.testing.assert_close(old.state_dict()[name], value, rtol=0, atol=0)
    old.close()
    e.step(batch(1))
    e.save(ck)
    assert ck.is_dir() and not ck.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "notes.txt"]  # the version moved inside
    assert ours(ck) == ["step-000001", "step-000002"] and (ck / "latest").read_text().strip() == "step-000002"
    assert MegaTrain.load(ck, verbose=False).step_count == 2
    assert MegaTrain.load(ck / "step-000001", verbose=False).step_count == 1
    e.close()


def test_an_export_never_replaces_a_save_of_the_previous_layout(tmp_path):
    e = new_engine()
    e.step(batch(0))
    ck = _previous_layout_save(e, tmp_path)
    before = tree(tmp_path)
    with pytest.raises(CheckpointRefused, match="holds a MegaTrain save"):
        e.save_pretrained(ck)
    assert tree(tmp_path) == before
    e.close()


def test_a_real_folder_save_of_an_older_layout_loads_but_is_not_overwritten(tmp_path):
    e = new_engine()
    e.step(batch(0))
    e.save(tmp_path / "scratch")
    shutil.move(tmp_path / "scratch" / "step-000001", tmp_path / "old")
    (tmp_path / "old" / layout.STEP_MARKER).unlink()
    assert MegaTrain.load(tmp_path / "old", verbose=False).step_count == 1
    before = tree(tmp_path / "old")
    with pytest.raises(CheckpointRefused, match="older layout"):
        e.save(tmp_path / "old")
    assert tree(tmp_path / "old") == before
    e.close()


# -- plain HF export --------------------------------------------------------------------------------
def test_save_pretrained_exports_a_plain_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    e = new_engine()
    e.step(batch(0))
    out = e.save_pretrained(tmp_path / "export")
    assert (out / "config.json").is_file() and not (out / "engine_state.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no leftovers beside it
    hf = AutoModelForCausalLM.from_pretrained(out)
    mine = e.state_dict()
    for name, value in hf.state_dict().items():
        key = "model.embed_tokens.weight" if name == "lm_head.weight" and SPEC.tie_embeddings else name
        torch.testing.assert_close(value, mine[key], rtol=0, atol=0)
    with pytest.raises(CheckpointRefused, match="not empty"):
        e.save_pretrained(out)
    e.close()


def test_initial_weights_are_written_whole_and_never_over_a_users_folder(tmp_path):
    from megatrain.checkpoint import write_initial_weights

    out = write_initial_weights(SPEC, tmp_path / "init")
    assert out.is_dir() and not out.is_symlink() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init"]  # no tmp folder or link beside it
    assert not (out / layout.PARTIAL).exists()
    before = tree(tmp_path)
    with pytest.raises(CheckpointRefused, match="not empty"):
        write_initial_weights(SPEC, out)
    assert tree(tmp_path) == before
    # a folder of the previous layout (a link to a hidden version, here evicted from a cache) is replaced
    shutil.rmtree(out)
    os.symlink(".init.v1796000000000000000-77", tmp_path / "init")
    write_initial_weights(SPEC, tmp_path / "init")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init"] and not (tmp_path / "init").is_symlink()
    MegaTrain.from_pretrained(tmp_path / "init", cfg(), verbose=False).close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_mixed_tiers_save_load_resume(tmp_path):
    """On the GPU, with AdamW state on both tiers: save, load, continue = uninterrupted (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    c = cfg(device="cuda", compute_dtype="fp32", gpu_resident="1", attn_implementation="sdpa")
    hf = SPEC.to_hf_config("sdpa")
    straight = MegaTrain.from_config(hf, c, verbose=False)
    expected = [straight.step(batch(i)).loss for i in range(4)]
    final = {k: v.clone() for k, v in straight.state_dict().items()}
    straight.close()
    first = MegaTrain.from_config(hf, c, verbose=False)
    losses = [first.step(batch(i)).loss for i in range(2)]
    first.save(tmp_path / "ck")
    first.close()
    resumed = MegaTrain.load(tmp_path / "ck", verbose=False)
    assert resumed.placement.gpu_layers == 1  # the saved engine config, placement included
    losses += [resumed.step(batch(i)).loss for i in range(2, 4)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=0)
    for name, value in resumed.state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=1e-6, atol=1e-7)
    resumed.close()
