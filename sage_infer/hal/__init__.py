"""Hardware abstraction: device detection, topology parsing, preset matching.

Nothing here imports a vendor plugin at module import time.
"""
