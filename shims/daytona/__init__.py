"""The Daytona shim: sandboxer's image as Daytona sandboxes (see shim.py)."""
