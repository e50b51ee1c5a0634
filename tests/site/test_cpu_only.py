"""A site run on ``--device cpu`` never touches CUDA.

The site's own processes (the ``geodiloco site run`` launcher and every rank; torchrun's agent
between them is torch's) start through a ``sitecustomize`` that replaces torch.cuda's entry
points: anything that would initialise CUDA, pick or use a device records the call and fails,
from any caller; the harmless queries (``is_available``, ``device_count``) fail only when
geodiloco's own code asks them, since torch's DeviceMesh and torchrun ask them on CPU too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from geodiloco.testing.configs import tiny_config
from geodiloco.testing.servers import CoordinatorThread

pytestmark = pytest.mark.integration

TRAP = """
import os
import sys
import traceback

if "LOCAL_RANK" in os.environ or str(os.getppid()) == os.environ.get("CUDA_TRAP_PARENT"):
    import torch

    def _trap(name, original, queries_only):
        def touched(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if queries_only and "geodiloco" not in caller:
                return original(*args, **kwargs)
            with open(os.environ["CUDA_TRAP_LOG"], "a") as log:
                log.write(f"torch.cuda.{name} in pid {os.getpid()}\\n" + "".join(traceback.format_stack()))
            raise RuntimeError(f"torch.cuda.{name} was called in a CPU-only run")

        return touched

    for name in ("is_available", "device_count"):
        setattr(torch.cuda, name, _trap(name, getattr(torch.cuda, name), True))
    for name in ("_lazy_init", "init", "set_device", "current_device", "synchronize",
                 "get_device_capability", "get_device_name", "mem_get_info", "Stream", "Event"):
        setattr(torch.cuda, name, _trap(name, None, False))
    with open(os.environ["CUDA_TRAP_LOG"] + ".armed", "a") as armed:
        armed.write(f"{os.getpid()}\\n")
"""


def _run_site(tmp_path: Path, target: str, device: str) -> tuple[int, str]:
    trap_dir = tmp_path / "trap"
    trap_dir.mkdir(exist_ok=True)
    (trap_dir / "sitecustomize.py").write_text(TRAP)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(trap_dir), os.environ.get("PYTHONPATH")])),
        "CUDA_TRAP_LOG": str(tmp_path / "cuda-calls.log"),
        "CUDA_TRAP_PARENT": str(os.getpid()),
    }
    cmd = [sys.executable, "-m", "geodiloco", "site", "run", "--name", "site-a", "--insecure"]
    cmd += ["--coordinator", target, "--nproc", "2", "--device", device]
    cmd += ["--layout", "fsdp", "--mixed-precision", "bf16"]
    cmd += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    with open(tmp_path / "site.log", "wb") as out:
        code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    return code, (tmp_path / "site.log").read_text()


def test_cpu_site_never_touches_cuda(tmp_path: Path) -> None:
    trap_log = tmp_path / "cuda-calls.log"
    cfg = tiny_config(rounds=2, sites=["site-a"])
    with CoordinatorThread(cfg) as coordinator:
        code, site_log = _run_site(tmp_path, coordinator.target, "cpu")
        assert not trap_log.exists(), trap_log.read_text()[-3000:]
        armed = (tmp_path / "cuda-calls.log.armed").read_text().split()
        assert len(armed) == 3, site_log[-3000:]  # the launcher and both ranks ran with the trap
        assert code == 0, site_log[-3000:]
        assert "layout: fsdp over 2 ranks (dp_replicate=1, dp_shard=2, tp=1, bf16) on cpu" in site_log
        history = coordinator.controller.history
        assert [h.round for h in history] == [0, 1] and all(h.hashes_agree for h in history)
        assert list((tmp_path / "ckpt").glob("round-*/site.json"))  # DCP wrote on the CPU path too


def test_the_trap_catches_a_site_that_asks_cuda(tmp_path: Path) -> None:
    code, _ = _run_site(tmp_path, "127.0.0.1:1", "auto")  # auto asks torch whether CUDA is there
    assert code != 0
    assert "torch.cuda.is_available" in (tmp_path / "cuda-calls.log").read_text()
