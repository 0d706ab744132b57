"""Test harness for real runtimes: Debian packages, containerd, runc, CRI client.  Test-only."""
