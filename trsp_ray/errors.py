"""User-facing errors: one line naming the bad value and what would be valid."""


class TrspError(ValueError):
    """Bad input or an impossible request. The CLI prints the message on one line and exits 2."""
