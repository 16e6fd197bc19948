"""The HTTP server: OpenAI-compatible API, SSE streaming, Prometheus metrics, admin API, auth."""
