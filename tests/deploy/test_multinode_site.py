"""deploy/k8s/multinode/: the Indexed Job form of a site on several GPU nodes, checked offline
against the Kubernetes API schemas, and its command line against the CLI's own checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from geodiloco.app.cli import build_parser
from geodiloco.site.daemon.launcher import Nodes
from geodiloco.site.parallel.layout import ParallelConfig

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "multinode" / "site.yaml"
K8S_VERSION = "1.30.0"


def _docs() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc}


@pytest.mark.parametrize("version", [K8S_VERSION, kubernetes_validate.latest_version()])
def test_multinode_manifests_validate(version: str) -> None:
    docs = _docs()
    assert sorted(docs) == ["Job", "PersistentVolumeClaim", "Service"]
    for doc in docs.values():
        kubernetes_validate.validate(doc, version, strict=True)


def test_indexed_job_forms_one_site_of_gpu_nodes_with_a_shared_checkpoint_volume() -> None:
    docs = _docs()
    job, service, claim = docs["Job"], docs["Service"], docs["PersistentVolumeClaim"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    nodes = spec["completions"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == nodes
    assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert container["resources"]["requests"]["nvidia.com/gpu"] == str(gpus)

    for index in range(nodes):  # what each pod runs, with the Job's index filled in
        argv = [a.replace("$(JOB_COMPLETION_INDEX)", str(index)) for a in container["args"]]
        args = build_parser().parse_args(argv)
        assert (args.nnodes, args.nproc, args.device) == (nodes, gpus, "cuda")
        node = Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, rdzv_id=args.name)
        assert f"--rdzv-conf=is_host={'true' if index == 0 else 'false'}" in node.torchrun_args()
        layout = ParallelConfig.parse(
            args.layout, args.nproc * args.nnodes, args.mixed_precision, args.nnodes
        )
        assert (layout.dp_replicate, layout.dp_shard) == (nodes, gpus)  # hsdp: a replica per node
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod 0's DNS name
    assert int(port) in {p["containerPort"] for p in container["ports"]}

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert args.checkpoint_dir == Path(mounts["checkpoints"])
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every node writes its own shards
