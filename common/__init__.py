"""Code shared by the coordinator and the worker: wire protocol, tensor codec, signatures.

Everything here is pure (no sockets, no files except explicit key load/save helpers), so
both sides and the tests use the same definitions of what is valid on the wire.
"""

PROTOCOL_VERSION = 4
