"""End-to-end tests against real container runtimes (see tests/harness/README.md)."""
