"""Integrations of the toolkit with trainers written elsewhere (each depends on the toolkit, never the other way)."""
