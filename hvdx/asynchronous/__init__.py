"""Shared-memory asynchronous SGD (filled in by the following modules)."""
