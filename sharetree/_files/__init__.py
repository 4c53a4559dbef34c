"""The checkpoint layer: files read and written (docs/architecture.md draws its inner order)."""
