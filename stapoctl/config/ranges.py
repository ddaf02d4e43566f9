"""Range strings shared by the schema modules (`spec(..., range=...)`)."""

POSITIVE_INT = "[1, inf)"
NON_NEGATIVE = "[0, inf)"
POSITIVE = "(0, inf)"

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray placement-group strategies
