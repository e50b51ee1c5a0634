"""The demo's set-up: each demo is a new run in its folder (a second `make demo` works)."""

from __future__ import annotations

from pathlib import Path

from geodiloco.app.demo import DemoPki


def test_a_second_demo_in_the_same_folder_starts_a_new_run(tmp_path: Path) -> None:
    """The first demo's coordinator state is sealed under its run secret; the next demo makes a new
    secret, so the old state must go with it (it was kept, and the second demo's coordinator refused
    to open it)."""
    first = DemoPki.create(tmp_path, ["site-1"])
    old_secret = first.dir.run_secret.read_bytes()
    state = tmp_path / "coordinator"
    state.mkdir()
    (state / "state.pt").write_bytes(b"sealed under the first secret")
    second = DemoPki.create(tmp_path, ["site-1"])
    assert not state.exists()
    assert second.dir.run_secret.read_bytes() != old_secret
    assert second.coordinator.cert.exists()
