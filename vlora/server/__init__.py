"""The OpenAI-compatible HTTP server (``vlora serve``): app.py routes, protocol.py wire format,
images.py image checks, metrics.py Prometheus metrics."""
