"""The `geodiloco` command: coordinator serve, site run, status, demo, baseline."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path

from geodiloco import __version__
from geodiloco.logs import setup_logging

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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geodiloco",
        description="Train one model across datacenters with DiLoCo over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"geodiloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    coord = sub.add_parser("coordinator", help="the outer-loop coordinator")
    coord_sub = coord.add_subparsers(dest="action", required=True)
    serve = coord_sub.add_parser("serve", help="serve a run to its sites")
    _add_config_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=50051, help="port (0 picks a free one)")
    serve.add_argument("--run-dir", type=Path, help="where the round log is written")
    serve.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    serve.add_argument(
        "--exit-when-finished",
        action="store_true",
        help="stop once the last round is committed and every site has left",
    )

    site = sub.add_parser("site", help="the per-site daemon")
    site_sub = site.add_subparsers(dest="action", required=True)
    run = site_sub.add_parser("run", help="train this site's share of the run")
    run.add_argument("--name", required=True, help="this site's name, as listed in the run's config")
    run.add_argument("--coordinator", default=DEFAULT_TARGET, help=f"host:port (default {DEFAULT_TARGET})")
    run.add_argument("--nproc", type=_positive_int, default=2, help="local ranks (default 2)")

    status = sub.add_parser("status", help="show the run's sites, round, loss and bytes")
    status.add_argument("--coordinator", default=DEFAULT_TARGET, help=f"host:port (default {DEFAULT_TARGET})")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")

    demo = sub.add_parser("demo", help="DiLoCo across 3 local sites, then the synchronous baseline")
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

    baseline = sub.add_parser("baseline", help="only the synchronous data-parallel baseline")
    _add_config_args(baseline)
    baseline.add_argument("--ranks-per-site", type=_positive_int, default=2)
    baseline.add_argument("--json", type=Path, dest="json_path", help="write the result JSON here")
    return parser


def _serve(args: argparse.Namespace) -> int:
    from geodiloco.config import load_config
    from geodiloco.coordinator.server import BindError, ServeOptions, serve

    cfg = load_config(args.config, args.overrides)
    opts = ServeOptions(
        host=args.host,
        port=args.port,
        run_dir=args.run_dir,
        port_file=args.port_file,
        exit_when_finished=args.exit_when_finished,
    )
    try:
        asyncio.run(serve(cfg, opts))
    except BindError as exc:
        print(f"geodiloco coordinator serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _site_run(args: argparse.Namespace) -> int:
    from geodiloco.site.launcher import run_site

    return run_site(args.coordinator, args.name, args.nproc)


def _status(args: argparse.Namespace) -> int:
    import grpc

    from geodiloco.status import fetch_status, format_status, status_dict

    try:
        status = fetch_status(args.coordinator)
    except grpc.RpcError as exc:
        print(
            f"geodiloco status: cannot reach {args.coordinator}: {exc.code().name} {exc.details()}",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(status_dict(status), indent=2) if args.json else format_status(status))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from geodiloco.demo import DemoOptions, demo_config, run_demo

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
    from geodiloco.config import load_config
    from geodiloco.demo import run_baseline

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(tempfile.mkdtemp(prefix="geodiloco-baseline-"))
    result = run_baseline(cfg, args.ranks_per_site, run_dir)
    if args.json_path:
        args.json_path.write_text(json.dumps(result, indent=2))
    print(f"final eval loss {result['final_eval_loss']:.4f}, WAN bytes {result['wan_bytes']:,}")
    return 0


COMMANDS = {
    ("coordinator", "serve"): _serve,
    ("site", "run"): _site_run,
    ("status", None): _status,
    ("demo", None): _demo,
    ("baseline", None): _baseline,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from geodiloco.config import ConfigError  # imports torch: only once a command will run

    setup_logging(site="" if args.command == "coordinator" else args.command)
    handler = COMMANDS[(args.command, getattr(args, "action", None))]
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"geodiloco {args.command}: invalid config: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
