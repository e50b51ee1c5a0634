"""The `geodiloco` command: coordinator serve, site run, status, report, export, certs, demo, baseline,
wan."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from geodiloco import __version__
from geodiloco.config_errors import ConfigError
from geodiloco.logs import FORMAT_ENV, FORMATS, setup_logging

if TYPE_CHECKING:
    from geodiloco.security.identity import Identity
    from geodiloco.security.tls import TlsFiles

STARTED = time.monotonic()  # a restarted coordinator logs its start from here (imports included)
log = logging.getLogger("geodiloco")
DEFAULT_TARGET = "127.0.0.1:50051"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="run config file (TOML or JSON); defaults otherwise")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config value, e.g. --set outer.momentum=0.5 (repeatable)",
    )


class UsageError(Exception):
    """A flag combination that cannot work; reported without a traceback."""


def _add_tls_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--tls-cert", type=Path, help=f"this {role}'s certificate (PEM)")
    p.add_argument("--tls-key", type=Path, help=f"this {role}'s private key (PEM)")
    p.add_argument("--tls-ca", type=Path, help="the CA that signs the run's certificates (PEM)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext without certificates, for local tests only: refused unless on loopback",
    )


def _tls(args: argparse.Namespace, host: str) -> TlsFiles | None:
    """The TLS files from the flags, or None after a warning when --insecure (loopback only)."""
    from geodiloco.security.policy import is_loopback
    from geodiloco.security.tls import TlsFiles

    given = (args.tls_cert, args.tls_key, args.tls_ca)
    if args.insecure:
        if any(given):
            raise UsageError("--insecure: drop the --tls-* flags or --insecure, not both")
        if not is_loopback(host):
            raise UsageError(
                f"--insecure: plaintext is refused for {host!r}; only loopback may go without mTLS"
            )
        print(
            f"WARNING: --insecure: plaintext gRPC on {host} without certificates or authorisation; "
            "for local tests only",
            file=sys.stderr,
        )
        return None
    if not all(given):
        raise UsageError("--tls-cert, --tls-key and --tls-ca are required (or --insecure on loopback)")
    try:
        return TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _target_host(target: str) -> str:
    return target.rpartition(":")[0] or target


def _check_certificates(
    tls: TlsFiles, target: str, role: str | None = None, name: str | None = None
) -> Identity | None:
    """Name a certificate problem here: through gRPC it would only look like an unreachable
    coordinator (UNAVAILABLE, retried for minutes). Returns the certificate's identity."""
    from geodiloco.security.certcheck import CertificateProblem, check_local, identity_of, probe_handshake

    try:
        cert = check_local(tls, role, name)
        probe_handshake(target, tls)
    except CertificateProblem as exc:
        raise UsageError(str(exc)) from None
    return identity_of(cert)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port (0-65535), got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (0-65535), got {value}")
    return value


def _log_format_arg(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument(
        "--log-format",
        choices=FORMATS,
        default=default,
        help=f"text for people (default) or JSON lines; also ${FORMAT_ENV}",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geodiloco",
        description="Train one model across datacenters with DiLoCo over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"geodiloco {__version__}")
    _log_format_arg(parser, None)
    # the same flag after the subcommand (`geodiloco site run ... --log-format json`)
    common = argparse.ArgumentParser(add_help=False)
    _log_format_arg(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    coord = sub.add_parser("coordinator", help="the outer-loop coordinator")
    coord_sub = coord.add_subparsers(dest="action", required=True)
    serve = coord_sub.add_parser("serve", parents=[common], help="serve a run to its sites")
    _add_config_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=50051, help="port (0 picks a free one)")
    serve.add_argument("--run-dir", type=Path, help="where the round log is written")
    serve.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    serve.add_argument(
        "--metrics-port", type=_port, help="serve Prometheus /metrics on --host at this port (0: any free)"
    )
    serve.add_argument(
        "--health-port",
        type=_port,
        help="also serve grpc.health.v1 alone, in plaintext, on --host at this port (for probes)",
    )
    serve.add_argument(
        "--exit-when-finished",
        action="store_true",
        help="stop once the last round is committed and every site has left",
    )
    _add_tls_args(serve, "coordinator")
    serve.add_argument(
        "--run-secret", type=Path, help="the run secret (32 bytes) that payload keys derive from"
    )

    site = sub.add_parser("site", help="the per-site daemon")
    site_sub = site.add_subparsers(dest="action", required=True)
    run = site_sub.add_parser("run", parents=[common], help="train this site's share of the run")
    run.add_argument("--name", required=True, help="this site's name, as listed in the run's config")
    run.add_argument("--coordinator", default=DEFAULT_TARGET, help=f"host:port (default {DEFAULT_TARGET})")
    run.add_argument("--nproc", type=_positive_int, default=2, help="local ranks (default 2)")
    run.add_argument("--nnodes", type=_positive_int, default=1, help="machines this site spans (default 1)")
    run.add_argument(
        "--node-rank", type=int, default=0, help="this machine's index; node 0 hosts the rendezvous"
    )
    run.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="node 0's address and a free port, the same on every node (torchrun's c10d rendezvous)",
    )
    run.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where each rank trains: its LOCAL_RANK's GPU (cuda), the CPU, or auto (default)",
    )
    run.add_argument(
        "--layout",
        default="ddp",
        help="parallel layout of the ranks: ddp (default), fsdp, hsdp, tp, fsdp+tp, ep, or "
        "pp=P,dp_replicate=R,dp_shard=S,tp=T[,ep=E][,microbatches=M] "
        "(P x R x S x T = --nproc x --nnodes; ep divides R)",
    )
    run.add_argument(
        "--mixed-precision",
        default="fp32",
        choices=("fp32", "bf16", "fp8"),
        help="bf16: FSDP2 bf16 parameters with fp32 reduction, or bf16 autocast (ddp, tp); "
        "fp8: torchao float8 linears on GPUs of compute capability 8.9+ (geodiloco[fp8])",
    )
    from geodiloco.site.parallel.layout_spec import ACTIVATION_CHECKPOINTING  # torch-free

    run.add_argument(
        "--activation-checkpointing",
        default="none",
        choices=ACTIVATION_CHECKPOINTING,
        help="parallel.activation_checkpointing: recompute each transformer block in the backward "
        "(block), or all but its matmul and attention outputs (selective); default none",
    )
    run.add_argument(
        "--compile",
        action="store_true",
        help="parallel.compile: torch.compile each transformer block (needs a C++ compiler on CPU)",
    )
    run.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="torch.distributed.checkpoint of the site's state; resumed on start",
    )
    run.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=None,
        metavar="N",
        help="checkpoint every N rounds (default: only on SIGTERM)",
    )
    run.add_argument(
        "--streams",
        type=_positive_int,
        default=1,
        metavar="N",
        help="TCP connections each rank's push and pull are spread over (default 1); more where "
        "one connection cannot fill a long WAN path",
    )
    _add_tls_args(run, "site")
    run.add_argument("--secret", type=Path, help="this site's secret file (site-NAME.secret) for sealing")
    run.add_argument(
        "--metrics-port", type=_port, help="rank 0 serves Prometheus /metrics at this port (0: any free)"
    )
    run.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")

    status = sub.add_parser("status", parents=[common], help="show the run's sites, round, loss and bytes")
    status.add_argument("--coordinator", default=DEFAULT_TARGET, help=f"host:port (default {DEFAULT_TARGET})")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_tls_args(status, "admin")

    health = sub.add_parser(
        "health", parents=[common], help="exit 0 if the coordinator's health service says SERVING"
    )
    health.add_argument(
        "--target",
        default="127.0.0.1:50052",
        help="host:port of the coordinator's --health-port (plaintext), or of its gRPC port with --tls-*",
    )
    health.add_argument("--service", default="", help="a service name to check (default: the server)")
    health.add_argument("--tls-cert", type=Path, help="client certificate, when checking the mTLS port")
    health.add_argument("--tls-key", type=Path, help="client private key")
    health.add_argument("--tls-ca", type=Path, help="the run's CA")

    report = sub.add_parser(
        "report", parents=[common], help="plots and a Markdown summary of a finished (or running) run"
    )
    report.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a coordinator --run-dir, or a demo's --run-dir"
    )
    report.add_argument("--out", type=Path, help="where to write (default RUN_DIR/report)")

    export = sub.add_parser(
        "export",
        parents=[common],
        help="write the committed global model in the model's own names (safetensors or DCP)",
    )
    export.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a coordinator --run-dir, or a demo's --run-dir"
    )
    export.add_argument("--format", choices=("safetensors", "dcp"), default="safetensors")
    export.add_argument("--out", type=Path, required=True, help="a new (or empty) directory")
    export.add_argument("--round", type=int, help="the committed round to export (default: the last)")
    export.add_argument("--run-secret", type=Path, help="the run secret, when the state is sealed")
    _add_config_args(export)  # the run's config; default RUN_DIR/config.json when there is one

    certs = sub.add_parser("certs", help="a development CA, certificates and run secrets")
    certs_sub = certs.add_subparsers(dest="action", required=True)
    init = certs_sub.add_parser("init", parents=[common], help="make a CA and a run secret in DIR")
    init.add_argument("dir", type=Path, metavar="DIR")
    issue = certs_sub.add_parser(
        "issue", parents=[common], help="issue a certificate (and a site's secret) from DIR's CA"
    )
    who = issue.add_mutually_exclusive_group(required=True)
    who.add_argument("--site", metavar="NAME", help="a site named in the run's config")
    who.add_argument("--coordinator", metavar="HOST[,HOST...]", help="the names/addresses sites dial")
    who.add_argument("--admin", metavar="NAME", help="an operator allowed to see details and stop the run")
    issue.add_argument(
        "--dir", type=Path, default=Path("pki"), help="the certificates directory (default pki)"
    )
    secret = certs_sub.add_parser(
        "secret", parents=[common], help="rotate DIR's run secret and re-derive its site secrets"
    )
    secret.add_argument(
        "--dir", type=Path, default=Path("pki"), help="the certificates directory (default pki)"
    )
    secret.add_argument("--rotate", action="store_true", required=True, help="replace the run secret")

    demo = sub.add_parser(
        "demo", parents=[common], help="DiLoCo across 3 local sites, then the synchronous baseline"
    )
    demo.add_argument("--json", type=Path, dest="json_path", help="also write the summary as JSON here")
    demo.add_argument("--run-dir", type=Path, help="keep logs and results here (default: a temp dir)")
    demo.add_argument("--sites", type=_positive_int, default=3, help="number of sites (default 3)")
    demo.add_argument("--ranks-per-site", type=_positive_int, default=2, help="ranks per site (default 2)")
    demo.add_argument("--no-baseline", action="store_true", help="skip the synchronous baseline")
    demo.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a demo config value, e.g. --set rounds=8 (repeatable)",
    )

    baseline = sub.add_parser(
        "baseline", parents=[common], help="only the synchronous data-parallel baseline"
    )
    _add_config_args(baseline)
    baseline.add_argument("--ranks-per-site", type=_positive_int, default=2)
    baseline.add_argument("--json", type=Path, dest="json_path", help="write the result JSON here")

    _add_wan_parser(sub, common)
    return parser


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), _port(port)


def _add_wan_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    wan = sub.add_parser(
        "wan",
        parents=[common],
        help="an emulated WAN link in front of the coordinator (rehearse a run behind it)",
        description="Forward --listen to --upstream through an emulated wide-area link: the sender "
        "is read at the link rate into a bounded buffer, and every byte arrives one latency later.",
    )
    wan.add_argument("--upstream", type=_host_port, required=True, help="HOST:PORT to forward to")
    wan.add_argument(
        "--listen", type=_host_port, default=("127.0.0.1", 0), help="HOST:PORT (default 127.0.0.1:0)"
    )
    wan.add_argument("--rate-mbps", type=float, default=0.0, help="link rate, Mbit/s (0: unlimited)")
    wan.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time, ms (half each way)")
    wan.add_argument("--jitter-ms", type=float, default=0.0, help="± variation of the one-way latency, ms")
    wan.add_argument(
        "--loss", type=float, default=0.0, help="chance in [0, 1) that a piece arrives a retransmission late"
    )
    wan.add_argument(
        "--buffer-bytes", type=int, default=0, help="bytes held per direction (0: twice the rate x delay)"
    )
    wan.add_argument("--seed", type=int, help="seed of the jitter and loss draws")
    wan.add_argument(
        "--control-port",
        type=_port,
        help="accept fault commands (partition [S], heal, delay MS S, drop) on 127.0.0.1:PORT",
    )


def _held_port(host: str, port: int | None) -> str | None:
    """Why ``host:port`` cannot be listened on when another socket holds it (its strerror);
    None when it is free, 0 or cannot be judged here (the bind itself then decides)."""
    import errno
    import socket

    if not port:
        return None
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.create_server(address[:2], family=family):
            return None
    except OSError as exc:
        return os.strerror(exc.errno) if exc.errno == errno.EADDRINUSE else None


def _serve(args: argparse.Namespace) -> int:
    # A port another process holds is refused at once, as the bind would refuse it, rather than
    # once the model is built and its dry step taken (seconds; minutes for a large model).
    for port, what in ((args.port, ""), (args.health_port, "health: "), (args.metrics_port, "metrics: ")):
        held = _held_port(args.host, port)
        if held is not None:
            where = f"{what}cannot listen on {args.host}:{port}"
            why = f": {held}" if what == "metrics: " else " (address in use or not available)"
            print(f"geodiloco coordinator serve: {where}{why}", file=sys.stderr)
            return 2
    if args.run_dir is not None:  # a restart: the snapshot is read while torch and the server load
        from geodiloco.coordinator.rundir import STATE_FILE
        from geodiloco.coordinator.unbuffered import read_ahead

        read_ahead(args.run_dir / STATE_FILE)
    from geodiloco.config import load_config
    from geodiloco.coordinator.durable import StateError
    from geodiloco.coordinator.edge.server import BindError, ServeOptions, serve

    cfg = load_config(args.config, args.overrides)
    try:
        opts = ServeOptions(
            host=args.host,
            port=args.port,
            run_dir=args.run_dir,
            port_file=args.port_file,
            exit_when_finished=args.exit_when_finished,
            tls=_tls(args, args.host),
            run_secret=args.run_secret,
            insecure=args.insecure,
            metrics_port=args.metrics_port,
            health_port=args.health_port,
            started=STARTED,
        )
        opts.security(cfg.run_id)  # reads the secret now, so a bad file stops us before serving
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        asyncio.run(serve(cfg, opts))
    except (BindError, StateError) as exc:  # StateError: the run directory's state is refused
        print(f"geodiloco coordinator serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_bindable(flag: str, host: str, port: int) -> None:
    """Refuse a busy port here, with the flag's name, not later in a rank's traceback."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise UsageError(f"{flag}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _site_run(args: argparse.Namespace) -> int:
    from geodiloco.prometheus import HOST_ENV, PORT_ENV
    from geodiloco.security.secrets import load_secret
    from geodiloco.site.daemon.launcher import run_site

    tls = _tls(args, _target_host(args.coordinator))
    if tls is not None:
        _check_certificates(tls, args.coordinator, role="site", name=args.name)
    if args.secret is None and not args.insecure:
        raise UsageError("--secret is required: the coordinator seals payloads (site-NAME.secret)")
    secret = None
    if args.secret is not None:
        try:
            secret = load_secret(args.secret)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    from geodiloco.site.daemon.launcher import Nodes, NodesError
    from geodiloco.site.parallel.layout_spec import LayoutError, ParallelConfig  # torch-free: the launcher

    try:
        nodes = Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, rdzv_id=args.name)
        ParallelConfig.parse(
            args.layout,
            args.nproc * args.nnodes,
            args.mixed_precision,
            args.nnodes,
            activation_checkpointing=args.activation_checkpointing,
            compile=args.compile,
        )
    except (LayoutError, NodesError) as exc:
        raise UsageError(f"--{exc}") from None
    if args.mixed_precision == "fp8" and args.device == "cpu":  # each GPU rank checks its own GPU
        raise UsageError(
            "--mixed-precision: fp8 needs a CUDA GPU of compute capability 8.9 or newer, not cpu"
        )
    if args.device == "cuda":  # asked for: fail here, not in every rank (auto and cpu ask nothing)
        from geodiloco.distributed import DeviceError, resolve_device

        try:
            resolve_device("cuda", args.nproc - 1)
        except DeviceError as exc:
            raise UsageError(f"--{exc}") from None
    extra = ["--layout", args.layout, "--mixed-precision", args.mixed_precision, "--device", args.device]
    extra += ["--streams", str(args.streams)]
    if args.activation_checkpointing != "none":
        extra += ["--activation-checkpointing", args.activation_checkpointing]
    extra += ["--compile"] if args.compile else []
    if args.checkpoint_every and args.checkpoint_dir is None:
        raise UsageError("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_dir is not None:
        extra += ["--checkpoint-dir", str(args.checkpoint_dir.resolve())]
        extra += ["--checkpoint-every", str(args.checkpoint_every or 0)]
    if args.metrics_port is not None:  # read by rank 0 (geodiloco.prometheus.SiteTelemetry)
        _check_bindable("--metrics-port", args.metrics_host, args.metrics_port)
        os.environ[PORT_ENV], os.environ[HOST_ENV] = str(args.metrics_port), args.metrics_host
    from geodiloco.site.edge.admission import NotAdmitted, check_admitted

    try:  # before torchrun, so a refusal is one line rather than a rank's traceback
        check_admitted(args.coordinator, args.name, tls, secret)
    except NotAdmitted as exc:
        raise UsageError(str(exc)) from None
    return run_site(args.coordinator, args.name, args.nproc, tls, args.secret, extra, nodes)


def _certs(args: argparse.Namespace) -> int:
    from geodiloco.security.pki import PkiDir

    try:
        if args.action == "init":
            PkiDir(args.dir).init()
            print(f"CA and run secret written to {args.dir}/ (keep ca-key.pem and run.secret private)")
        elif args.action == "secret":
            rewritten = PkiDir(args.dir).rotate_secret()
            print(f"new run secret in {args.dir}/run.secret; re-derived {len(rewritten)} site secrets:")
            for path in rewritten:
                print(f"  {path}")
        elif args.site:
            files, secret = PkiDir(args.dir).issue_site(args.site)
            print(f"site {args.site}: {files.cert} {files.key} (CA {files.ca}), secret {secret}")
        elif args.coordinator:
            hosts = [h.strip() for h in args.coordinator.split(",") if h.strip()]
            files = PkiDir(args.dir).issue_coordinator(hosts)
            print(f"coordinator {', '.join(hosts)}: {files.cert} {files.key} (CA {files.ca})")
        else:
            files = PkiDir(args.dir).issue_admin(args.admin)
            print(f"admin {args.admin}: {files.cert} {files.key} (CA {files.ca})")
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return 0


def _status(args: argparse.Namespace) -> int:
    import grpc

    from geodiloco.app.status import fetch_status, format_status, visible_dict

    tls = _tls(args, _target_host(args.coordinator))
    viewer = None  # plaintext (loopback): the coordinator shows everything
    if tls is not None:
        identity = _check_certificates(tls, args.coordinator)
        viewer = None if identity and identity.role == "admin" else str(identity or "no geodiloco identity")
    try:
        status = fetch_status(args.coordinator, tls)
    except grpc.RpcError as exc:
        print(
            f"geodiloco status: cannot reach {args.coordinator}: {exc.code().name} {exc.details()}",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(visible_dict(status, viewer), indent=2) if args.json else format_status(status, viewer))
    return 0


def _health(args: argparse.Namespace) -> int:
    """For container and exec probes: no output when SERVING, a reason otherwise."""
    import grpc

    from geodiloco.app.status import check_health
    from geodiloco.security.tls import TlsFiles

    given = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(given) and not all(given):
        raise UsageError(
            "--tls-cert, --tls-key and --tls-ca go together (none for a plaintext --health-port)"
        )
    try:
        tls = TlsFiles(*given) if all(given) else None
        state = check_health(args.target, tls, args.service)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except grpc.RpcError as exc:
        print(f"geodiloco health: {args.target}: {exc.code().name} {exc.details()}", file=sys.stderr)
        return 1
    if state != "SERVING":
        print(f"geodiloco health: {args.target}: {state}", file=sys.stderr)
        return 1
    return 0


def _report(args: argparse.Namespace) -> int:
    from geodiloco.app.report import ReportError, write_report

    try:
        report = write_report(args.run_dir, args.out)
    except ReportError as exc:
        raise UsageError(str(exc)) from None
    print(f"report written to {report.markdown}")
    for plot in report.plots:
        print(f"  {plot.path}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from geodiloco.app.export import ExportError, export
    from geodiloco.config import load_config

    config = args.config
    if config is None:  # a coordinator's (or a demo's) run directory holds the run's config
        config = args.run_dir / "config.json"
        if not config.is_file():
            raise UsageError(f"--config: give the run's config ({args.run_dir} holds no config.json)")
    cfg = load_config(config, args.overrides)
    try:
        done = export(cfg, args.run_dir, args.out, args.format, args.run_secret, args.round)
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    print(
        f"round {done['round']} of run {done['run_id']} ({done['parameters']:,} parameters, hash "
        f"{str(done['state_hash'])[:12]}) written to {args.out} as {args.format}"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from geodiloco.app.demo import DemoOptions, demo_config, run_demo

    opts = DemoOptions(
        sites=args.sites,
        ranks_per_site=args.ranks_per_site,
        run_dir=args.run_dir,
        json_path=args.json_path,
        overrides=args.overrides,
        baseline=not args.no_baseline,
    )
    demo_config(opts)  # validate before starting any process
    try:
        run_demo(opts)
    except RuntimeError as exc:
        print(f"geodiloco demo failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _baseline(args: argparse.Namespace) -> int:
    from geodiloco.app.demo import run_baseline
    from geodiloco.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(tempfile.mkdtemp(prefix="geodiloco-baseline-"))
    result = run_baseline(cfg, args.ranks_per_site, run_dir)
    if args.json_path:
        args.json_path.write_text(json.dumps(result, indent=2))
    print(f"final eval loss {result['final_eval_loss']:.4f}, WAN bytes {result['wan_bytes']:,}")
    return 0


def _wan(args: argparse.Namespace) -> int:
    from geodiloco.app.wan import LinkConfig, serve

    checks = [
        (args.rate_mbps >= 0, "--rate-mbps", "must be >= 0"),
        (args.rtt_ms >= 0, "--rtt-ms", "must be >= 0"),
        (0 <= args.jitter_ms <= args.rtt_ms / 2, "--jitter-ms", "must be in [0, --rtt-ms / 2]"),
        (0 <= args.loss < 1, "--loss", "must be in [0, 1)"),
        (args.buffer_bytes == 0 or args.buffer_bytes >= 1024, "--buffer-bytes", "must be 0 or >= 1024"),
    ]
    for ok, flag, message in checks:
        if not ok:
            raise UsageError(f"{flag}: {message}, got {getattr(args, flag[2:].replace('-', '_'))}")
    link = LinkConfig(
        latency_ms=args.rtt_ms / 2,
        bandwidth_mbps=args.rate_mbps,
        jitter_ms=args.jitter_ms,
        loss=args.loss,
        buffer_bytes=args.buffer_bytes,
        seed=args.seed,
    )
    try:
        asyncio.run(serve(args.listen, args.upstream, link, args.control_port))
    except OSError as exc:
        raise UsageError(f"--listen/--control-port: cannot listen: {exc.strerror or exc}") from None
    return 0


COMMANDS = {
    ("coordinator", "serve"): _serve,
    ("site", "run"): _site_run,
    ("status", None): _status,
    ("report", None): _report,
    ("health", None): _health,
    ("certs", "init"): _certs,
    ("certs", "issue"): _certs,
    ("certs", "secret"): _certs,
    ("demo", None): _demo,
    ("export", None): _export,
    ("baseline", None): _baseline,
    ("wan", None): _wan,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.log_format:  # torchrun's ranks and the demo's processes inherit it
        os.environ[FORMAT_ENV] = args.log_format
    try:
        setup_logging(role=args.command, site=getattr(args, "name", "") or "", fmt=args.log_format)
    except ValueError as exc:  # a bad GEODILOCO_LOG_FORMAT
        print(f"geodiloco: {exc}", file=sys.stderr)
        return 2
    handler = COMMANDS[(args.command, getattr(args, "action", None))]
    import grpc

    try:
        return handler(args)
    except grpc.RpcError as exc:  # a refusal no command handled: its reason, not a traceback
        code = exc.code().name if isinstance(exc, grpc.Call) else "ERROR"
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        print(f"geodiloco {args.command}: the coordinator answered {code}: {details}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"geodiloco {args.command}: invalid config: {exc}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"geodiloco {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
