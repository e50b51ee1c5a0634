"""The one exception every decoder raises on bad input."""


class CodecError(ValueError):
    """A payload or tensor that a codec refuses: truncated, corrupted, mislabelled, non-finite."""
