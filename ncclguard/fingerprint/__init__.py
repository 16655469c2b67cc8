"""The fingerprint model (docs/fingerprint.md)."""
