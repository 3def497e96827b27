"""The OpenAI-compatible HTTP server: app, protocol, errors, generation, metrics, the engine thread, the serve
options and the `serve` command."""
