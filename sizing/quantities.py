"""Byte quantities as users write them: an integer, or a Kubernetes binary quantity (512Mi, 8Gi, 1Ti)."""

from __future__ import annotations

import re

from hybridkv.sizing.errors import CapacityError

_QUANTITY = re.compile(r"^(\d{1,20})(Ki|Mi|Gi|Ti)?$")
_FACTORS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def parse_bytes(text: str) -> int:
    """Bytes from "268435456", "256Mi" or "8Gi"; CapacityError for anything else, zero included."""
    match = _QUANTITY.match(str(text).strip())
    if not match or int(match.group(1)) == 0:
        raise CapacityError(
            f"the cache memory must be a positive number of bytes such as 268435456 or 8Gi, got {text!r}"
        )
    return int(match.group(1)) * _FACTORS[match.group(2)]
