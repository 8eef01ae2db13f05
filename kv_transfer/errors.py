"""Typed transfer failures: the serving layer turns these into a local re-prefill. They are the handover seam's
failures (`engine.interface.HandoverFailed`, `BadTicket`), so a role catches them without knowing the transfer."""

from splitserve.engine.interface import BadTicket, HandoverFailed


class TransferError(HandoverFailed):
    """A transfer failed (peer gone, bad data, backend error)."""


class TransferTimeout(TransferError):
    """The transfer did not complete before its deadline."""


class TransferCancelled(TransferError):
    """The transfer was cancelled by its owner."""


class MalformedTicket(TransferError, BadTicket):
    """A ticket that does not parse or validate."""


class IncompatibleLayout(MalformedTicket):
    """The ticket's KV layout (layers, dtype, block bytes) does not match ours."""
