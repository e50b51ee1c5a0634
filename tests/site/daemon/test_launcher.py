"""`geodiloco site run`'s node flags: torchrun's command line, and clear refusals."""

from __future__ import annotations

import pytest
import torch

from geodiloco.app.cli import main
from geodiloco.site.daemon.launcher import Nodes, NodesError, worker_command
from geodiloco.site.parallel.layout_spec import LayoutError, ParallelConfig


def test_one_node_is_standalone_and_many_meet_at_node_0() -> None:
    assert "--standalone" in worker_command("m", 2, [])
    first = Nodes(2, 0, "10.0.0.5:29400", rdzv_id="dc-west").torchrun_args()
    other = Nodes(2, 1, "10.0.0.5:29400", rdzv_id="dc-west").torchrun_args()
    assert first == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.5:29400",
        "--rdzv-id=dc-west",
        "--rdzv-conf=is_host=true",
    ]
    assert other[-1] == "--rdzv-conf=is_host=false" and other[:-1] == first[:-1]
    cmd = worker_command("geodiloco.site.daemon.worker", 4, ["--x"], Nodes(2, 1, "h:1"))
    assert "--standalone" not in cmd and "--nproc-per-node=4" in cmd and "--max-restarts=0" in cmd


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ((2, 0, None), "rdzv-endpoint: a site on several nodes needs HOST:PORT of node 0"),
        ((2, 2, "h:1"), r"node-rank: 2 must be in \[0, 2\)"),
        ((2, 0, "h"), "rdzv-endpoint: 'h' is not HOST:PORT"),
        ((2, 0, "h:99999"), "rdzv-endpoint: 'h:99999' is not HOST:PORT"),
    ],
)
def test_bad_node_settings_name_the_flag(nodes: tuple[int, int, str | None], message: str) -> None:
    with pytest.raises(NodesError, match=message):
        Nodes(*nodes)


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 8), (3, 8), (4, 2), (5, 1)])
def test_hsdp_shards_inside_each_node_and_replicates_across_them(nodes: int, per_node: int) -> None:
    """Any node count, not just two: a replica per node, FSDP2 over the node's own ranks (the
    mesh's inner dim, which torchrun fills with one node's consecutive ranks)."""
    layout = ParallelConfig.parse("hsdp", nodes * per_node, "bf16", nodes)
    assert (layout.dp_replicate, layout.dp_shard, layout.name) == (
        nodes,
        per_node,
        "hsdp" if per_node > 1 else "ddp",
    )


def test_hsdp_on_one_node_keeps_two_replicas_and_says_when_they_do_not_fit() -> None:
    assert ParallelConfig.parse("hsdp", 8) == ParallelConfig(dp_replicate=2, dp_shard=4)
    with pytest.raises(LayoutError, match="dp_replicate 2 x dp_shard 1 x tp 1 must equal the site's 3 ranks"):
        ParallelConfig.parse("hsdp", 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")
def test_site_run_refuses_cuda_where_torch_sees_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["site", "run", "--name", "a", "--insecure", "--device", "cuda"]) == 2
    assert "--device: cuda was asked for but torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "2"], "--rdzv-endpoint: a site on several nodes needs HOST:PORT of node 0"),
        (["--nnodes", "2", "--node-rank", "3", "--rdzv-endpoint", "h:1"], "--node-rank: 3 must be in"),
        (
            ["--layout", "dp_shard=3", "--nnodes", "2", "--rdzv-endpoint", "h:1"],
            "--layout: dp_replicate 1 x dp_shard 3 x tp 1 must equal the site's 4 ranks",
        ),
        (["--mixed-precision", "fp8", "--device", "cpu"], "--mixed-precision: fp8 needs a CUDA GPU"),
        (
            ["--mixed-precision", "fp8", "--layout", "tp"],
            "--mixed-precision: fp8 is not supported with tensor",
        ),
    ],
)
def test_site_run_refuses_bad_node_and_precision_flags(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["site", "run", "--name", "a", "--insecure", *flags])
    assert code == 2
    assert message in capsys.readouterr().err
