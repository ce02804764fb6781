"""Projection handlers: how KHA is carried by each kind of projection (one file per handler)."""
