"""The gRPC protocol between router and workers (generated stubs + validation)."""

PROTOCOL_VERSION = 1
