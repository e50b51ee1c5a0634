"""The wings' import rules ([tool.importlinter] in pyproject.toml, run by `make lint`) hold on
the code as it is, and an import that crosses a wing breaks the contract that forbids it.

The violations are added to the import graph import-linter builds from the installed package,
so no source file is touched: the contracts checked are exactly those `make lint` checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from grimp import ImportGraph
from importlinter.adapters.building import GraphBuilder
from importlinter.application import use_cases
from importlinter.application.app_config import settings
from importlinter.configuration import configure

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
Lint = Callable[[list[tuple[str, str]], str], bool]


class WithExtraImports(GraphBuilder):
    """The real graph, plus the imports a test adds (importer, imported)."""

    def __init__(self, extra: list[tuple[str, str]]) -> None:
        self.extra = extra

    def build(self, *args: object, **kwargs: object) -> ImportGraph:
        graph = super().build(*args, **kwargs)  # type: ignore[arg-type]
        for importer, imported in self.extra:
            graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="import")
        return graph


@pytest.fixture
def lint() -> Iterator[Lint]:
    """``lint(extra_imports, contract_id)``: whether that contract is kept ("" for all of them)."""
    configure()
    saved = settings.copy()

    def run(extra: list[tuple[str, str]], contract: str) -> bool:
        settings.configure(GRAPH_BUILDER=WithExtraImports(extra))
        code = use_cases.lint_imports(
            str(PYPROJECT), limit_to_contracts=(contract,) if contract else (), cache_dir=None, no_logo=True
        )
        return code == use_cases.SUCCESS

    yield run
    settings.configure(**saved._config)


def test_every_contract_holds_on_the_code(lint: Lint) -> None:
    assert lint([], "")


@pytest.mark.parametrize(
    ("importer", "imported", "contract"),
    [
        ("geodiloco.coordinator.rounds", "grpc", "no-grpc-in-cores"),
        ("geodiloco.coordinator.intake", "geodiloco.v1.outer_sync_pb2", "no-grpc-in-cores"),
        ("geodiloco.site.outer_sync", "geodiloco.wire", "no-grpc-in-cores"),
        ("geodiloco.site.outer_sync", "geodiloco.site.edge.grpc_link", "site-core-below-the-rest"),
        ("geodiloco.site.outer_sync", "geodiloco.coordinator.rounds", "wings"),
        ("geodiloco.coordinator.rounds", "geodiloco.site.link", "wings"),
        ("geodiloco.coordinator.rounds", "geodiloco.testing.local_link", "wings"),
        ("geodiloco.config", "geodiloco.app.cli", "wings"),
        ("geodiloco.coordinator.rounds", "geodiloco.coordinator.edge.service", "coordinator-core-below-edge"),
        ("geodiloco.site.parallel.layout", "geodiloco.site.edge.client", "inside-a-site"),
    ],
)
def test_an_import_across_a_wing_breaks_its_contract(
    lint: Lint, importer: str, imported: str, contract: str
) -> None:
    assert lint([], contract)  # kept without it
    assert not lint([(importer, imported)], contract)
