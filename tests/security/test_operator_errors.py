"""Operator mistakes get one line, and a site certificate's status says what it may see (issue 17)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from geodiloco.security.tls import TlsFiles

from .conftest import Pki, secure_coordinator

pytestmark = pytest.mark.integration


def geodiloco(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geodiloco", *args], capture_output=True, text=True, timeout=60
    )


def tls_args(files: TlsFiles) -> list[str]:
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


def test_site_run_with_a_name_off_the_allow_list_is_one_line(pki: Pki) -> None:
    from geodiloco.testing.configs import tiny_config

    files, secret = pki.sites["site-x"]  # a valid certificate of the run's CA; the run names a, b
    with secure_coordinator(pki, tiny_config(sites=["site-a", "site-b"])) as c:
        result = geodiloco(
            "site", "run", "--name", "site-x", "--coordinator", c.target, "--nproc", "1",
            "--secret", str(secret), *tls_args(files),
        )  # fmt: skip
        assert all(s.state != "joined" for s in c.controller.sites.values())  # the probe joined nobody
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "refuses site 'site-x'" in lines[0] and "is not part of run 'test-run'" in lines[0]


def test_site_run_with_the_wrong_secret_is_one_line_and_joins_nobody(pki: Pki, other_pki: Pki) -> None:
    """The admission probe carries the key proof (issue 16 items 5 and 8): a wrong secret is
    refused before torchrun starts, in one line, and the site never becomes a member."""
    from geodiloco.testing.configs import tiny_config

    files, _ = pki.sites["site-a"]
    _, wrong = other_pki.sites["site-a"]
    with secure_coordinator(pki, tiny_config(sites=["site-a", "site-b"])) as c:
        result = geodiloco(
            "site", "run", "--name", "site-a", "--coordinator", c.target, "--nproc", "1",
            "--secret", str(wrong), *tls_args(files),
        )  # fmt: skip
        assert all(s.state == "absent" for s in c.controller.sites.values())
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "refuses site 'site-a'" in lines[0] and "does not hold its secret" in lines[0]


def test_status_with_a_site_certificate_says_what_it_may_see(pki: Pki) -> None:
    from geodiloco.testing.configs import tiny_config

    with secure_coordinator(pki, tiny_config(sites=["site-a", "site-b"])) as c:
        site = tls_args(pki.sites["site-a"][0])
        table = geodiloco("status", "--coordinator", c.target, *site)
        as_json = geodiloco("status", "--coordinator", c.target, "--json", *site)
        admin = geodiloco("status", "--coordinator", c.target, *tls_args(pki.admin))
    assert table.returncode == 0, table.stderr
    assert "round 0/3" in table.stdout and "(site site-a) may see only" in table.stdout
    assert "admin certificate" in table.stdout
    assert "up 0s" not in table.stdout and "0 of 0 windows" not in table.stdout
    data = json.loads(as_json.stdout)
    assert data["view"] == "site site-a" and "admin certificate" in data["details"]
    assert data["round"] == 0 and data["rounds_total"] == 3 and "sites" not in data
    assert admin.returncode == 0 and "site-a" in admin.stdout and "windows consumed" in admin.stdout
