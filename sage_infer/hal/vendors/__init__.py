"""Per-vendor device probes. Each module exposes ``probe() -> VendorReport`` and imports
its vendor's torch plugin only inside ``probe`` so a missing plugin is a reason, not an
ImportError."""
