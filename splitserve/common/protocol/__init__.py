"""The gRPC protocol between router and workers (generated stubs + validation)."""

PROTOCOL_VERSION = 1


class RequestIdInUse(ValueError):
    """A request id that a request in flight on this worker already has: ALREADY_EXISTS on the wire."""
