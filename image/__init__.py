"""pyproxy's container image: `make image` (build.py) and the OCI archives it writes (oci.py).
Beside the package, not in it: nothing here ships, and nothing here imports the test kit."""
