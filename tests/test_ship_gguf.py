"""scripts/ship_gguf.sh: the GGUF travels to the offline GPU node in parts, one per device call, each call
keeping its part in a stash that outlives the call's working tree; the file is whole again only when every
part arrived, and byte for byte the original."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _sh(cmd: str, gdir: Path, stash: Path, sha: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GGUF_DIR=str(gdir), GGUF_STASH=str(stash), GGUF_SHA256=sha, MAX_PART_MIB="1")
    return subprocess.run(["bash", str(ROOT / "scripts" / "ship_gguf.sh"), *cmd.split()], env=env,
                          capture_output=True, text=True, timeout=120)


def test_three_calls_carry_three_parts_and_join_restores_the_file(tmp_path):
    data = os.urandom(int(2.5 * (1 << 20)))  # 2.5 MiB at 1 MiB per part: three parts
    src = tmp_path / NAME
    src.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    here = tmp_path / "here"
    here.mkdir()
    (here / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"not used: gguf is importable in the test env")
    p = _sh(f"split {src}", here, tmp_path / "unused", sha)
    assert p.returncode == 0, p.stdout + p.stderr
    parts = sorted(here.glob(f"{NAME}.part*"))
    assert [x.name[-5:] for x in parts] == ["part0", "part1", "part2"] and (here / "PARTS.sha256").is_file()
    # a wrong file is refused at split time, nothing written
    bad = tmp_path / "bad" / NAME
    bad.parent.mkdir()
    bad.write_bytes(data[:-1])
    assert _sh(f"split {bad}", tmp_path / "bad_out", tmp_path / "unused", sha).returncode == 1

    stash = tmp_path / "device_tmp_gguf"
    for k, part in enumerate(parts):  # one device call per part: its working tree holds only that part
        call = tmp_path / f"call{k}"
        call.mkdir()
        for f in (part, here / "PARTS.sha256", here / "SHA256SUMS", here / "gguf-0.19.0-py3-none-any.whl"):
            shutil.copy(f, call / f.name)
        p = _sh("stash", call, stash, sha)
        if k < 2:
            assert p.returncode == 1 and f"{k + 1} of 3 parts on this machine" in p.stdout, p.stdout + p.stderr
            assert _sh("join", call, stash, sha).returncode == 1  # not whole yet: refused, no file left
            assert not (call / NAME).exists()
        else:
            assert p.returncode == 0 and "all 3 parts" in p.stdout, p.stdout + p.stderr
    p = _sh("join", call, stash, sha)
    assert p.returncode == 0 and "sha256 ok" in p.stdout, p.stdout + p.stderr
    assert (call / NAME).read_bytes() == data
    # a stale part in the stash (another file's) is caught before join
    (stash / f"{NAME}.part1").write_bytes(b"stale")
    assert _sh("stash", tmp_path / "call0", stash, sha).returncode == 1
