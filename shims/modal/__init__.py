"""The Modal shim: sandboxer's image as a Modal Sandbox (see shim.py)."""
