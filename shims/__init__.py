"""Host-side shims: one adapter per host. They start the runtime image and then talk to the
supervisor only over its WebSocket (shared/DESIGN.md); see shims/README.md."""
