"""A job's own opt-out: the word ``ncclguard=off`` in its comment (22.05) or its
``--extra`` (23.02 on), honoured when ``[gate] allow_opt_out`` is on (docs/gate.md). One
home for the gate and the collector's action on a mixed job (docs/runtime.md).

Standard library only: the gate reads it for every job.
"""

from __future__ import annotations

__all__ = ["OPT_OUT", "opted_out"]

OPT_OUT = "ncclguard=off"


def opted_out(*texts: str) -> bool:
    """Whether ``ncclguard=off`` is a word (split at blanks, ``,`` and ``;``) of any of
    ``texts``, in any case."""
    for text in texts:
        words = text.replace(",", " ").replace(";", " ").split()
        if any(w.lower() == OPT_OUT for w in words):
            return True
    return False
