"""The package version (a leaf module: the run store records it without importing
`scalescope` itself)."""

__version__ = "0.1.0"
