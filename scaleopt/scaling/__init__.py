"""scaleopt.scaling (see docs/architecture.md)."""
