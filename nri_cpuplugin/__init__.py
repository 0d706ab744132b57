"""nri-cpuplugin: exclusive, topology-aware CPU sets for Kubernetes containers."""

# The one place the version is written: pyproject.toml reads it from here ([tool.setuptools.
# dynamic]), so the package metadata, `nri-cpuplugin --version`, `status`, the metrics, the
# audit trail and the state file all say the same.  A plain assignment: the OCI hook imports
# this package at every container start and must not pay for importlib.metadata.
__version__ = "0.1.0"
