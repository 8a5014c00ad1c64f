"""Built-in transport backends; importing this package registers them."""

from sage_infer.transport.backends import shm, tcp, torchdist  # noqa: F401
