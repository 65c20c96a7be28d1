"""scaleopt.train (see docs/architecture.md)."""
