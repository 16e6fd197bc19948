"""Kubernetes resource quantities (``64Gi``, ``2Mi``, ``500m``, ``1.5G``) as exact numbers.

Owns the quantity strings used in the CR spec (their grammar and their value, computed as the kubernetes
client's ``parse_quantity`` does: the tests hold the two equal), so that the operator can size hugepages,
check cross-field rules and pass plain byte counts to the runtime's flags. Pure: no Kubernetes API, no Kopf.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal

# The subset of the Kubernetes quantity grammar that the CRD accepts.
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
_EXPONENTS = {"m": -1, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}  # a suffix's power of its base (Ki: K)


class QuantityError(ValueError):
    """A string that is not a quantity in the accepted grammar."""


def parse_quantity(value: str | int) -> Decimal:
    """Return the exact value of a quantity: ``"2Mi"`` -> 2097152, ``"500m"`` -> 0.5."""
    if isinstance(value, bool):
        raise QuantityError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError(f"negative quantity: {value}")
        return Decimal(value)
    text = str(value).strip()
    match = _QUANTITY_RE.match(text)
    if match is None:
        raise QuantityError(f"not a quantity: {value!r} (expected e.g. 64Gi, 2Mi, 500m, 8)")
    suffix = match.group(2) or ""
    number = Decimal(text.removesuffix(suffix) if suffix else text)
    if not suffix:
        return number
    base = 1024 if suffix.endswith("i") else 1000
    return number * (base ** Decimal(_EXPONENTS[suffix[0]]))


def to_bytes(value: str | int) -> int:
    """A quantity as a whole number of bytes, rounded up as Kubernetes does for memory."""
    return int(parse_quantity(value).to_integral_value(rounding=ROUND_CEILING))


def is_quantity(value: object) -> bool:
    """True when ``value`` parses as a quantity."""
    try:
        parse_quantity(value)  # type: ignore[arg-type]
    except (QuantityError, TypeError):
        return False
    return True


def format_bytes(value: int) -> str:
    """Bytes as a short binary quantity: 16777216 -> ``16Mi``, 1610612736 -> ``1.5Gi``, 1000 -> ``1000``."""
    if value < 1024:
        return str(value)
    for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if value >= size:
            text = f"{value / size:.1f}".removesuffix(".0")
            return f"{text}{suffix}"
    return str(value)  # pragma: no cover - the loop always returns for value >= 1024


def exact_quantity(value: int) -> str:
    """Bytes as a quantity that says exactly that many: the largest binary suffix that divides them
    (3221225472 -> ``3Gi``, 1415577600 -> ``1350Mi``, 1000 -> ``1000``), for values a CR can take as written."""
    for suffix, size in (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if value >= size and value % size == 0:
            return f"{value // size}{suffix}"
    return str(value)
