"""scripts/dp_train.py under torchrun on CPU (gloo): one node of 2 processes, and two "nodes" of one process
each on localhost (a host store per node); both train the same global batches, so their losses agree."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["scripts/dp_train.py", "--model", "tiny-llama", "--device", "cpu", "--batch", "2", "--seq", "32",
        "--steps", "2", "--warmup", "1", "--threads", "1", "--timeout-s", "60", "--gpu-resident", "0"]


pytestmark = pytest.mark.timeout(600)  # two torchrun launches of up to 120 s each, and their cleanup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *extra]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def test_torchrun_one_node_and_two_nodes(tmp_path):
    one = subprocess.run(_torchrun("--nproc-per-node", "2", "--master-port", str(_free_port()), *ARGS,
                                   "--out", str(tmp_path), "--name", "one"),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    port = str(_free_port())
    nodes = [subprocess.Popen(_torchrun("--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                                        "--master-addr", "127.0.0.1", "--master-port", port, *ARGS,
                                        "--out", str(tmp_path), "--name", "two"),
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in nodes]
    finally:  # a node that hung (or the test failing) must not outlive the test
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outs)
    one_row = json.loads((tmp_path / "one.jsonl").read_text())
    two_row = json.loads((tmp_path / "two.jsonl").read_text())
    assert (one_row["gpus"], one_row["nodes"]) == (2, 1) and (two_row["gpus"], two_row["nodes"]) == (2, 2)
    assert one_row["status"] == two_row["status"] == "ok"
    torch.testing.assert_close(torch.tensor(one_row["losses"]), torch.tensor(two_row["losses"]), rtol=1e-5, atol=0)
    assert one_row["losses"][0] != one_row["losses"][-1]
