"""Shipped helpers for tests and demos that drive the whole stack (edges, simulator, Envoy)."""
