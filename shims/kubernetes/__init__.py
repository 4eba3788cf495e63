"""The Kubernetes shim: manifests for sandboxer boxes on a cluster (see generate.py)."""
