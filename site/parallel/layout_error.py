"""The one refusal of the parallel layouts, below both `layout` and `plans` so neither imports the other's."""


class LayoutError(ValueError):
    """A layout that does not fit the site's ranks or that this version cannot build."""
