"""Fault plans: validation, placement at (site, rank, round, step), once per plan, and real
effects (a process SIGKILLed, a real WAN proxy partitioned, delayed and reset)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from geodiloco.app.wan import ProxyThread
from geodiloco.faults import Fault, FaultInjector, FaultPlan, FaultPlanError, InjectedCrash, fired, load_plan

LINK = "127.0.0.1:1"


def write_plan(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"faults": [{"action": "nuke", "site": "a", "round": 1}]}, "faults[0].action: unknown 'nuke'"),
        (
            {"faults": [{"action": "kill", "site": "a", "round": -1}]},
            "faults[0].round: must be an integer >= 0",
        ),
        ({"faults": [{"action": "kill", "site": "a"}]}, "faults[0]: "),  # no round
        (
            {"faults": [{"action": "drop", "site": "a", "round": 1}]},
            "faults[0].site: a drop needs links",
        ),
        (
            {"links": {"a": LINK}, "faults": [{"action": "partition", "site": "a", "round": 1}]},
            "faults[0].seconds: a partition needs a duration > 0",
        ),
        (
            {"faults": [{"action": "kill", "site": "a", "round": 1, "target": "coordinator"}]},
            "faults[0].target: killing the coordinator needs coordinator_pid",
        ),
        ({"fault": []}, "fault: unknown field; accepted: coordinator_pid, faults, links"),
    ],
)
def test_bad_plans_name_the_field(tmp_path: Path, data: dict[str, Any], message: str) -> None:
    with pytest.raises(FaultPlanError) as err:
        load_plan(write_plan(tmp_path, data))
    assert message in str(err.value)


def test_plan_round_trips_through_its_file(tmp_path: Path) -> None:
    plan = FaultPlan(
        faults=[Fault(action="delay", site="a", round=3, step=2, rank=1, seconds=2.0, delay_ms=50.0)],
        links={"a": LINK},
    )
    plan.write(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan


def test_link_faults_land_at_their_step_once_even_across_restarts(tmp_path: Path) -> None:
    with ProxyThread("127.0.0.1:1", control_port=0) as proxy:
        link = proxy.control_address
        plan = write_plan(
            tmp_path,
            {
                "links": {"a": link, "b": link},
                "faults": [
                    {"action": "partition", "site": "a", "round": 2, "step": 1, "seconds": 30},
                    {
                        "action": "delay",
                        "site": "a",
                        "rank": 1,
                        "round": 0,
                        "step": 0,
                        "seconds": 30,
                        "delay_ms": 80,
                    },
                    {"action": "drop", "site": "b", "round": 0, "step": 0},
                ],
            },
        )
        injector = FaultInjector(plan, "a", 0)
        for position in [(0, 0), (1, 5), (2, 0)]:
            injector.reached(*position)
        assert not proxy.proxy.partitioned and fired(plan) == {}  # other sites' and ranks' faults wait
        injector.reached(2, 1)
        time.sleep(0.1)
        assert proxy.proxy.partitioned
        assert fired(plan)[0]["round"] == 2 and fired(plan)[0]["step"] == 1
        proxy.heal()
        again = FaultInjector(plan, "a", 0)  # the site restarted and trains round 2 again
        again.reached(2, 1)
        time.sleep(0.1)
        assert not proxy.proxy.partitioned  # a fault fires once per plan
        late = FaultInjector(plan, "a", 1)
        late.reached(1, 3)  # a catch-up skipped (0, 0): it fires at the first step after
        time.sleep(0.1)
        assert fired(plan)[1]["round"] == 1 and proxy.proxy.extra_delay_ms(time.monotonic()) == 80


KILL_ME = """
import sys
from pathlib import Path
from geodiloco.faults import FaultInjector
FaultInjector(Path(sys.argv[1]), "a", 0).reached(int(sys.argv[2]), 0)
print("alive", flush=True)
"""


def test_kill_is_a_sigkill_of_the_site_or_of_the_coordinator(tmp_path: Path) -> None:
    coordinator = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        plan = write_plan(
            tmp_path,
            {
                "coordinator_pid": coordinator.pid,
                "faults": [
                    {"action": "kill", "site": "a", "round": 1},
                    {"action": "kill", "site": "a", "round": 3, "target": "coordinator"},
                ],
            },
        )
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}  # not under torchrun

        def site(round_: int) -> subprocess.CompletedProcess[str]:
            argv = [sys.executable, "-c", KILL_ME, str(plan), str(round_)]
            return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)

        assert site(0).stdout == "alive\n"  # before its round
        assert site(1).returncode == -9  # killed where placed
        assert site(1).stdout == "alive\n"  # restarted: it fired already
        assert site(3).stdout == "alive\n"
        assert coordinator.wait(10) == -9
        assert sorted(fired(plan)) == [0, 1]
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (
            {"action": "raise", "round": 1, "at": "commit"},
            'faults[0].target: at commit: must be "coordinator"',
        ),
        (
            {"action": "drop", "site": "a", "round": 1, "target": "coordinator"},
            "faults[0].target: only a kill or",
        ),
        (
            {"action": "raise", "site": "a", "round": 1, "target": "coordinator"},
            "faults[0].at: a raise fires only",
        ),
        (
            {"action": "kill", "round": 1, "at": "commit"},
            'faults[0].target: at commit: must be "coordinator"',
        ),
        (
            {"action": "drop", "site": "a", "round": 1, "at": "commit"},
            "faults[0].action: at commit: only kill",
        ),
        ({"action": "kill", "site": "a", "round": 1, "at": "mid"}, "faults[0].at: unknown 'mid'"),
        ({"action": "kill", "round": 1, "at": "push"}, "faults[0].site: must name a site"),
        ({"action": "kill", "site": "a", "round": 1, "at": "pull", "chunk": -2}, "faults[0].chunk: must be"),
        ({"action": "slow", "site": "a", "round": 1}, "faults[0].factor: a slow needs a factor in (1, 100"),
        ({"action": "slow", "site": "a", "round": 1, "factor": 0.5}, "faults[0].factor: a slow needs"),
        ({"action": "slow", "site": "a", "round": 1, "factor": "2"}, "faults[0].factor: a slow needs"),
        ({"action": "slow", "site": "a", "round": 1, "at": "push", "factor": 2}, "faults[0].at: a slow"),
        ({"action": "kill", "site": "a", "round": 1, "factor": 2}, "faults[0].factor: only a slow"),
    ],
)
def test_bad_placements_name_the_field(tmp_path: Path, fault: dict[str, Any], message: str) -> None:
    with pytest.raises(FaultPlanError) as err:
        load_plan(write_plan(tmp_path, {"coordinator_pid": 1, "faults": [fault]}))
    assert message in str(err.value)


def test_push_pull_and_commit_faults_fire_at_their_chunk_and_round_once(tmp_path: Path) -> None:
    with ProxyThread("127.0.0.1:1", control_port=0) as proxy:
        plan = write_plan(
            tmp_path,
            {
                "links": {"a": proxy.control_address},
                "faults": [
                    {"action": "drop", "site": "a", "round": 2, "at": "push", "chunk": 3},
                    {
                        "action": "delay",
                        "site": "a",
                        "round": 2,
                        "at": "pull",
                        "chunk": 0,
                        "seconds": 30,
                        "delay_ms": 9,
                    },
                    {"action": "raise", "round": 4, "at": "commit", "target": "coordinator"},
                    {"action": "kill", "round": 5, "at": "commit", "target": "coordinator"},
                ],
            },
        )
        site, coordinator = FaultInjector(plan, "a", 0), FaultInjector(plan, None)
        for chunk in range(3):
            site.reached(2, chunk, "push")
        site.reached(2, 5, "step")  # an inner step is not a push
        site.reached(3, 0, "commit")  # nor does a site fire a commit fault
        coordinator.reached(3, 0, "commit")  # nor the coordinator one of a later round
        assert fired(plan) == {}
        site.reached(2, 3, "push")
        assert fired(plan)[0]["step"] == 3 and fired(plan)[0]["fault"]["at"] == "push"
        site.reached(2, 0, "pull")  # the commit reached the site: nothing taken yet
        time.sleep(0.1)
        assert proxy.proxy.extra_delay_ms(time.monotonic()) == 9
        with pytest.raises(InjectedCrash, match="raise at commit of round 4"):
            coordinator.reached(4, 0, "commit")
        assert sorted(fired(plan)) == [0, 1, 2]
        FaultInjector(plan, None).reached(4, 0, "commit")  # a restarted coordinator: fired already
        assert at_commit_pid(plan) == os.getpid()


def at_commit_pid(plan: Path) -> int:
    """The kill at commit ends the process that commits: it fires in a child, not in this test."""
    child = subprocess.run(
        [sys.executable, "-c", KILL_AT_COMMIT, str(plan)], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == -9 and child.stdout == "", child.stderr
    assert fired(plan)[3]["fault"]["at"] == "commit" and fired(plan)[3]["round"] == 5
    return os.getpid()


KILL_AT_COMMIT = """
import sys
from pathlib import Path
from geodiloco.faults import FaultInjector
FaultInjector(Path(sys.argv[1]), None).reached(5, 0, "commit")
print("alive", flush=True)
"""

PUSH_AND_DIE = """
import sys
import torch
from geodiloco.compression import encode_chunks, parse_pipeline
from geodiloco.site.edge.client import OuterSyncClient
client = OuterSyncClient(sys.argv[1], "site-a")
client.join()
codec = parse_pipeline("q8|zstd:3")
chunks, _ = encode_chunks(codec, torch.randn(int(sys.argv[2])) * 1e-2, 256, round_=0)
client.push(0, codec.spec, chunks, tokens=10)
print("pushed", len(chunks), flush=True)
"""


def test_a_site_killed_mid_push_leaves_the_round_without_its_part(tmp_path: Path) -> None:
    from geodiloco.testing.configs import tiny_config
    from geodiloco.testing.servers import CoordinatorThread

    plan = write_plan(
        tmp_path, {"faults": [{"action": "kill", "site": "site-a", "round": 0, "at": "push", "chunk": 2}]}
    )
    with CoordinatorThread(tiny_config(min_sites=2)) as coordinator:
        n = coordinator.controller.num_params
        env = {**os.environ, "GEODILOCO_FAULT_PLAN": str(plan), "RANK": "0"}
        env.pop("TORCHELASTIC_RUN_ID", None)
        argv = [sys.executable, "-c", PUSH_AND_DIE, coordinator.target, str(n)]
        child = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        assert child.returncode == -9, child.stderr[-2000:]
        assert fired(plan)[0]["step"] == 2  # two of its chunks had gone
        assert not coordinator.controller.mean.contributors  # the part never completed
        assert coordinator.controller.round == 0


def test_slow_stretches_every_rank_of_its_site_from_its_step_on(tmp_path: Path) -> None:
    """A slow is a state of the site: each of its ranks waits out (factor - 1) x its own step
    from the planned point on, the later slow wins, other sites compute as before; the named
    rank records it once, where it first took effect, also across a restart."""
    plan = write_plan(
        tmp_path,
        {
            "faults": [
                {"action": "slow", "site": "a", "rank": 1, "round": 2, "step": 3, "factor": 2},
                {"action": "slow", "site": "a", "round": 4, "factor": 3.5},
            ]
        },
    )
    waits: dict[tuple[str, int], list[float]] = {}
    for site, rank in [("a", 0), ("a", 1), ("b", 0)]:
        injector = FaultInjector(plan, site, rank)
        injector.sleep = waits.setdefault((site, rank), []).append
        for position in [(0, 0), (2, 2), (2, 3), (3, 0), (4, 0), (5, 7)]:
            injector.stretch(*position, elapsed_s=0.25)
    assert waits[("a", 0)] == waits[("a", 1)] == [0.25, 0.25, 0.625, 0.625]
    assert waits[("b", 0)] == []
    records = fired(plan)
    assert (records[0]["round"], records[0]["step"], records[1]["round"]) == (2, 3, 4)
    again = FaultInjector(plan, "a", 1)  # a restarted site is still slow, and records nothing new
    again.sleep = waits[("a", 1)].append
    assert again.stretch(2, 5, elapsed_s=0.1) == pytest.approx(0.1)
    assert fired(plan) == records
