"""ZenFlow (baselines/zenflow.py) and the spawn-safety of the point entry, on the CPU.

ZenFlow itself needs CUDA for bf16 training, so what runs here is: its config (checked by DeepSpeed's own
schema), its host-memory estimate, the registry record, the refusal of micro-batches; and, through the
real runner and ``python -m experiments.point``, a fake system that starts a child process with the
"spawn" method at build time, as ZenFlow and SuperOffload do (the child re-imports the entry module as
``__mp_main__``): the point must finish normally, once, and a point killed after its build must still
carry the system's settings in its row (ZenFlow's "not exact AdamW" facts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_baselines_registry import OPTIM, init_dirs  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).resolve().with_name("baselines_spawn_fake.py")  # loaded by the point process


# -- config and estimates ---------------------------------------------------------------------------
def test_zenflow_config_is_the_tutorials_and_deepspeed_accepts_it():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from baselines.zenflow import ZENFLOW_DEFAULTS, make_zenflow_ds_config, zenflow_config

    zf = zenflow_config({"topk_ratio": 0.1})
    assert zf == dict(ZENFLOW_DEFAULTS, topk_ratio=0.1)
    assert ZENFLOW_DEFAULTS["update_interval"] == 4 and ZENFLOW_DEFAULTS["overlap_step"] is True
    cfg = make_zenflow_ds_config(OPTIM, bf16=True, zenflow=zf, pin_memory=False)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["zenflow"]["topk_ratio"] == 0.1 and zero["overlap_comm"] is True
    assert cfg["gradient_clipping"] == OPTIM.max_grad_norm
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["lr"] == OPTIM.lr
    parsed = DeepSpeedZeroConfig(**zero)  # DeepSpeed's own validation of every key
    assert parsed.zenflow.topk_ratio == 0.1 and parsed.zenflow.update_interval == 4
    with pytest.raises(ValueError, match="unknown zenflow options"):
        zenflow_config({"topk": 0.1})


def test_host_bytes_per_param_from_the_deepspeed_code():
    from baselines.zenflow import host_bytes_per_param

    assert host_bytes_per_param()["total"] == 44  # tutorial: overlap_step, pinned, bf16
    assert host_bytes_per_param(pin_memory=False)["total"] == 36
    assert host_bytes_per_param(overlap_step=False)["total"] == 20
    # what it means on the 126 GiB H200 host: 3B does not fit, 1.5B does
    from megatrain.spec import PRESETS

    host = 126 * 2**30
    assert 44 * PRESETS["qwen2.5-3b"].num_params() > host > 44 * PRESETS["qwen2.5-1.5b"].num_params() * 1.5


def test_registry_record_and_refusals(init_dirs):
    pytest.importorskip("deepspeed")
    from baselines import SYSTEM_RECORDS, build_system

    rec = SYSTEM_RECORDS["zenflow"]
    assert rec.builder == "build" and rec.module == "baselines.zenflow" and not rec.runs_on_cpu
    assert "not exact AdamW" in rec.label
    with pytest.raises(ValueError, match="micro_batches must be 1"):
        build_system("zenflow", init_dir=init_dirs["tiny-llama"], optim=OPTIM, micro_batches=2, device="cpu")
    with pytest.raises(ValueError, match="unknown zenflow options"):
        build_system("zenflow", init_dir=init_dirs["tiny-llama"], optim=OPTIM, device="cpu", options={"stage": 3})
    with pytest.raises(ValueError, match="optimizer must be one of"):
        build_system("zenflow", init_dir=init_dirs["tiny-llama"], optim=OPTIM, device="cpu",
                     options={"optimizer": "torch_adamw"})


def test_superoffload_recipe_and_clipping_settings():
    from baselines.zero3 import make_ds_config, settings_of

    so = make_ds_config(1024, OPTIM, 1, bf16=True, torch_optimizer=False, variant="superoffload")
    zero = so["zero_optimization"]
    assert zero["sub_group_size"] == 4e8 and zero["reduce_bucket_size"] == 4e8 and zero["overlap_comm"] is False
    s = settings_of(so)
    assert s["speculation"] is False and s["gradient_clipping"] == OPTIM.max_grad_norm
    from dataclasses import replace

    s0 = settings_of(make_ds_config(1024, replace(OPTIM, max_grad_norm=0.0), 1, bf16=True, torch_optimizer=False,
                                    variant="superoffload"))
    assert s0["speculation"] is True and s0["gradient_clipping"] == 0.0
    z3 = make_ds_config(1024, OPTIM, 1, bf16=True, torch_optimizer=False, variant="zero3")["zero_optimization"]
    assert z3["sub_group_size"] == 1e9 and z3["overlap_comm"] is True  # the others keep their settings


def test_superoffload_noclip_system_turns_clipping_off(monkeypatch, init_dirs):
    import baselines.zero3 as z
    from baselines import build_system

    seen = {}

    def fake_build(self, init_dir, opts, dtype, activation_checkpointing):
        cfg = self._make_config(type("C", (), {"hidden_size": 64})(), opts, True, "cpu_adam")
        seen["cfg"] = cfg
        self.info.update(system=self.name, settings=z.settings_of(cfg), optimizer="DeepSpeedCPUAdam")

    monkeypatch.setattr(z.DeepSpeedSystem, "_build", fake_build)
    system = build_system("superoffload_noclip", init_dir=init_dirs["tiny-llama"], optim=OPTIM, device="cpu")
    try:
        assert system.name == "superoffload_noclip" and system.optim.max_grad_norm == 0.0
        assert seen["cfg"]["gradient_clipping"] == 0.0
        assert system.info["settings"]["speculation"] is True
        assert system.info["settings"]["run_max_grad_norm_ignored"] == OPTIM.max_grad_norm
    finally:
        system.close()


def test_superoffload_dead_worker_is_the_cause(monkeypatch):
    """A worker that died: the row's status is an error naming its exit code, not DeepSpeed's timeout."""
    from baselines import failure_status
    from baselines.zero3 import DeepSpeedSystem, SuperOffloadSystem

    system = SuperOffloadSystem.__new__(SuperOffloadSystem)

    def timeout(self, batch, t0):
        raise RuntimeError("SuperOffload CPU optimizer timeout after 60.0 seconds. Still waiting for 3/3")

    monkeypatch.setattr(DeepSpeedSystem, "_step", timeout)
    for alive, status, text in ((False, "error", "exited with code -9"), (True, "timeout", "alive")):
        monkeypatch.setattr(SuperOffloadSystem, "worker_state",
                            lambda self, a=alive: {"pid": 7, "alive": a, "exitcode": None if a else -9,
                                                   "cores": 15, "pt_cores": 1})
        with pytest.raises(RuntimeError) as err:
            system._step({}, 0.0)
        assert failure_status(err.value) == status and text in str(err.value)


# -- spawn safety through the real runner and point process -------------------------------------------
def _conf(root: Path, flag_dir: Path) -> Path:
    (root / "system").mkdir(parents=True)
    (root / "sweep").mkdir(parents=True)
    for name, kill in (("_spawn_ok", "null"), ("_spawn_killed", 1)):
        (root / "system" / f"{name}.yaml").write_text(
            f"name: {name}\nfactory: '{FAKE}:spawning_system'\noptions:\n  kill_at: {kill}\n"
            f"  flag_dir: '{flag_dir}'\n")
    (root / "sweep" / "_spawn.yaml").write_text("""# @package _global_
defaults:
  - override /model: tiny-qwen2
sweep:
  name: _spawn
  systems: [_spawn_ok, _spawn_killed]
device: cpu
steps: 2
warmup_steps: 1
seq_len: 16
batch_size: 2
timeout_s: 180
torch_threads: 1
""")
    return root


def test_point_entry_is_spawn_safe_and_a_killed_point_keeps_its_settings(tmp_path):
    from experiments import schema

    flags = tmp_path / "flags"
    flags.mkdir()
    conf = _conf(tmp_path / "conf", flags)
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "sweep=_spawn", f"hydra.searchpath=[file://{conf}]",
                           f"results_dir={results}", f"cache_dir={tmp_path / 'cache'}", "post=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    rows = {r["system"]: r for _, r in schema.read_results(results / "_spawn" / "results.csv").iterrows()}
    ok, killed = rows["_spawn_ok"], rows["_spawn_killed"]
    assert ok["status"] == "ok", (ok["error"], proc.stdout[-2000:], proc.stderr[-2000:])
    # one child per point: the child re-imported experiments.point as __mp_main__ and did not train again
    assert len(list(flags.glob("child_ran_*"))) == 2
    lines = (results / "_spawn" / ok["point"] / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3, lines  # warmup 1 + steps 2, written once
    assert killed["status"] == "host_oom" and "SIGKILL" in killed["error"]
    assert json.loads(killed["settings"])["exact_adamw"] is False  # from system_info.json, written at build


def test_importing_the_point_module_as_mp_main_does_nothing():
    """What the spawn child does first: run experiments.point's top level as __mp_main__. It must not
    train, parse arguments or import torch."""
    code = ("import runpy, sys; sys.argv = ['x', '/nonexistent/job.json']; "
            "runpy.run_module('experiments.point', run_name='__mp_main__', alter_sys=True); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- ZenFlow itself on the CPU (DeepSpeed's CPU accelerator, fp32): needs the cpu_adam JIT build -------
@pytest.mark.skipif(os.environ.get("MEGATRAIN_TEST_CPU_ADAM") != "1",
                    reason="JIT-compiles DeepSpeed's cpu_adam (~45 s on a free machine); set MEGATRAIN_TEST_CPU_ADAM=1")
def test_zenflow_trains_on_cpu_not_exact_adamw_with_visible_staleness(init_dirs):
    """Sequential (overlap_step false) and overlapped ZenFlow on the tiny model, 6 steps, update_interval 4:
    * step 0 equals native's (the shared initial weights; without ``fix_layout`` DeepSpeed 0.19.8
      scrambles every 2-D weight at initialize and step 0 differs), later steps do not (not exact AdamW);
    * one CPU update (at step 3) and a grad norm only there;
    * both modes agree until the CPU update is applied; at step 4 the sequential mode already sees it and
      the overlapped one does not (staleness);
    * the overlapped mode's optimizer process (spawned) is stopped by close(), the CPU affinity restored."""
    from test_baselines_registry import batches, run_system

    preset, data = "tiny-llama", batches("tiny-llama", 6)
    native, *_ = run_system("native", init_dirs[preset], data, micro_batches=1)
    affinity = os.sched_getaffinity(0)
    runs = {}
    for overlap in (False, True):
        results, _, memory, info, label = run_system("zenflow", init_dirs[preset], data, micro_batches=1,
                                                     options={"zenflow": {"overlap_step": overlap}})
        runs[overlap] = [r.loss for r in results]
        assert label == "zenflow" and info["optimizer"] == "ZenFlowCPUAdam"
        assert info["settings"]["exact_adamw"] is False and "not exact AdamW" in info["notes"]
        assert info["settings"]["layout_fix"] is True
        assert info["settings"]["select_interval_effective"] == 0 and info["settings"]["overlap_step"] is overlap
        assert memory.extra["zenflow_cpu_updates"] == 1
        norms = [r.grad_norm for r in results]
        assert [n == n for n in norms] == [False, False, False, True, False, False]  # NaN off the boundary
        assert os.sched_getaffinity(0) == affinity
    assert runs[False][0] == pytest.approx(native[0].loss, rel=1e-6)
    assert runs[True][0] == pytest.approx(native[0].loss, rel=1e-6)
    assert abs(runs[False][2] - native[2].loss) > 1e-4  # not AdamW: most columns wait for the CPU update
    assert runs[True][:4] == pytest.approx(runs[False][:4], rel=1e-6)
    assert abs(runs[True][4] - runs[False][4]) > 1e-5  # overlapped: step 3's CPU update not yet applied
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.is_alive()]
    # DeepSpeed's own layout (fix_layout false): the weights it trains are not the shared ones
    raw, _, _, info, _ = run_system("zenflow", init_dirs[preset], data[:1], micro_batches=1,
                                    options={"zenflow": {"overlap_step": False}, "fix_layout": False})
    assert info["settings"]["layout_fix"] is False
    assert abs(raw[0].loss - native[0].loss) > 1e-3
