"""The gRPC protocol between callers and workers: the generated stubs, the conversion to and from the worker
protocol's dataclasses with the validation of every field received (`convert`), and the worker's side of the
wire (`server`); the caller's side is `splitserve.common.worker_client`."""

PROTOCOL_VERSION = 1
