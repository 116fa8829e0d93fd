"""The package version, in its own module so that any layer can read it without importing the root."""

__version__ = "0.2.0"
