"""deploy/systemd's units read as systemd reads them, for the tests beside this file: directives,
the environment a service gets (Environment=, then EnvironmentFile= over it, then the
directories' variables), ExecStart's argument vector, the paths ProtectSystem=strict leaves
writable, and a sandbox that enforces those paths on a command (mount namespace, as systemd does)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SYSTEMD = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
EXECUTABLE = "/opt/geodiloco/bin/geodiloco"


@dataclass(frozen=True, slots=True)
class Roots:
    """Where systemd's %S (state) and %C (cache) roots lie: /var/lib and /var/cache on a host."""

    state: str = "/var/lib"
    cache: str = "/var/cache"


@dataclass(frozen=True, slots=True)
class Unit:
    name: str
    text: str

    @classmethod
    def read(cls, name: str) -> Unit:
        return cls(name, (SYSTEMD / name).read_text())

    def directives(self, section: str = "Service") -> list[tuple[str, str]]:
        """(key, value) in order, continuation lines joined, comments dropped."""
        out, current = [], None
        for line in self.text.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("["):
                current = line.strip("[]")
            elif line and not line.startswith(("#", ";")) and current == section:
                key, _, value = line.partition("=")
                out.append((key.strip(), value.strip()))
        return out

    def values(self, key: str) -> list[str]:
        return [v for k, v in self.directives() if k == key]

    def expand(self, text: str, instance: str, roots: Roots) -> str:
        """The specifiers these units use: %i (instance), %S and %C (state and cache roots)."""
        table = {"i": instance, "S": roots.state, "C": roots.cache, "%": "%"}
        return re.sub(r"%(.)", lambda m: table[m.group(1)], text)

    def state_directories(self, instance: str, roots: Roots) -> list[str]:
        return [
            f"{roots.state}/{self.expand(d, instance, roots)}"
            for v in self.values("StateDirectory")
            for d in v.split()
        ]

    def environment(self, env_file: str, instance: str, roots: Roots) -> dict[str, str]:
        """Environment= first, EnvironmentFile= over it (systemd's order), then $STATE_DIRECTORY."""
        env: dict[str, str] = {}
        for value in self.values("Environment"):
            env.update(item.split("=", 1) for item in shlex.split(self.expand(value, instance, roots)))
        for line in env_file.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                env[key.strip()] = value.strip()
        states = self.state_directories(instance, roots)
        if states:
            env["STATE_DIRECTORY"] = ":".join(states)
        return env

    def exec_start(self, env: dict[str, str], instance: str, roots: Roots) -> list[str]:
        """ExecStart's argument vector: ${VAR} is one argument, as systemd substitutes it."""
        (command,) = self.values("ExecStart")
        words = shlex.split(self.expand(command, instance, roots))
        return [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w) for w in words]

    def writable(self, instance: str, roots: Roots) -> list[str]:
        """What ProtectSystem=strict leaves writable: the state and cache directories and
        ReadWritePaths= (a leading ``-`` marks an optional one); /tmp is private (PrivateTmp=)."""
        paths = self.state_directories(instance, roots)
        paths += [f"{roots.cache}/{self.expand(d, instance, roots)}" for v in self.values("CacheDirectory")
                  for d in v.split()]  # fmt: skip
        paths += [self.expand(p, instance, roots).lstrip("-") for v in self.values("ReadWritePaths")
                  for p in v.split()]  # fmt: skip
        return paths


# ProtectSystem=strict and PrivateTmp=yes, as systemd builds them, in a user and mount namespace:
# the test's tree (under /tmp) is carried over the private /tmp, every mount but the API
# filesystems, /tmp and the writable paths is remounted read-only, then the command runs.
_SANDBOX = r"""
set -eu
hold=$1; tree=$2; shift 2
count=$1; shift
writable=""
while [ "$count" -gt 0 ]; do writable="$writable
$1"; shift; count=$((count - 1)); done
mount --rbind "$tree" "$hold"
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p "$tree"
mount --rbind "$hold" "$tree"
umount -l "$hold"
echo "$writable" | while IFS= read -r w; do [ -z "$w" ] || mount --bind "$w" "$w"; done
awk '{print $5}' /proc/self/mountinfo | while IFS= read -r mp; do
  case "$mp" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*|/tmp) continue ;; esac
  if ! echo "$writable" | grep -qxF "$mp"; then mount -o remount,bind,ro "$mp" 2>/dev/null || true; fi
done
exec "$@"
"""


def sandbox_problem() -> str | None:
    """Why the sandbox cannot be built here (None: it can)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "unshare or mount is missing"
    if _holder() is None:
        return "no empty folder outside /tmp to carry the test's tree over the private /tmp"
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /tmp"], capture_output=True, text=True
    )
    return None if probe.returncode == 0 else f"unshare -rm refused: {probe.stderr.strip()}"


def _holder() -> str | None:
    """A folder outside /tmp to mount over inside the namespace (nothing outside it changes)."""
    return next((d for d in ("/media", "/srv", "/mnt") if Path(d).is_dir()), None)


def sandboxed(argv: list[str], tree: Path, writable: list[str]) -> list[str]:
    """``argv`` under ProtectSystem=strict with ``writable`` allowed; ``tree`` (under /tmp) stays
    visible over the private /tmp."""
    holder = _holder()
    assert holder is not None
    prefix = ["unshare", "-rm", "sh", "-c", _SANDBOX, "sandbox", holder, str(tree)]
    return [*prefix, str(len(writable)), *writable, *argv]
