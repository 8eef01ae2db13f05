"""Layer-by-layer KV streaming from a prefill worker into blocks a decode worker reserved.

`KVTransferAgent` is one per worker: the receiver side (decode) reserves nothing itself but publishes
`TransferTicket`s for blocks the engine reserved and awaits them; the sender side (prefill) streams each
layer's blocks the moment the engine's layer hook says they are written. Backends: NIXL (UCX) and TCP.
"""

from splitserve.kv_transfer.agent import KVTransferAgent, SendSession, make_agent
from splitserve.kv_transfer.errors import (
    IncompatibleLayout,
    MalformedTicket,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.ticket import TransferTicket

__all__ = [
    "IncompatibleLayout",
    "KVLayout",
    "KVTransferAgent",
    "MalformedTicket",
    "SendSession",
    "TransferCancelled",
    "TransferError",
    "TransferTicket",
    "TransferTimeout",
    "make_agent",
]
