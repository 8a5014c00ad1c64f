"""sage_infer: LLM inference built around KV-cache reuse.

Importing this package loads no optional heavy module (torch is imported by the parts
that need it, vendor plugins only by their probes).
"""

__version__ = "0.1.0"
