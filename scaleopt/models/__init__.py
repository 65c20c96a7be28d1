"""scaleopt.models (see docs/architecture.md)."""
