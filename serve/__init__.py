"""The HTTP completion service: a thin FastAPI layer over a jfire engine."""
