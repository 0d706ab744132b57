"""nri-cpuplugin: exclusive, topology-aware CPU sets for Kubernetes containers."""

# The version `nri-cpuplugin --version`, `status`, the metrics, the audit trail and the state
# file report; pyproject.toml's [project] version is the same (tests/unit/test_cli.py keeps
# them equal: the image build and the package metadata read that one).  A plain assignment:
# the OCI hook imports this package at every container start and must not pay for
# importlib.metadata.
__version__ = "0.2.0"
