"""Host-side shims: one adapter per host. They start the runtime image and then talk to the
supervisor only over its WebSocket (docs/architecture.md); see shims/README.md."""
