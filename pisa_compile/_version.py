"""The package version (a leaf module: importable from anywhere in the package)."""

__version__ = "0.1.0"
